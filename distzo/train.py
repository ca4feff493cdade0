"""The training driver: DESIGN §2's step, top to bottom.

    batch -> plan -> my evaluations on my shard -> exchange (loss sum, count) -> projected
    gradients -> identical update on every rank -> log -> (snapshot)

Everything the loop needs is built once by `build_run` (including, with resume=auto, the newest
valid snapshot); `_train` is the loop itself. On a PxD mesh each rank runs the evaluations dealt to
its perturbation index on the shard of the global batch given to its data index; only scalars are
exchanged, and every rank applies the same update.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import secrets
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from .checkpoint import (atomic_write_json, newest_valid_snapshot, read_snapshot, save_final, snapshots_dir,
                         write_snapshot)
from .data.tasks import ClassificationTask, TrainSampler
from .dist.consistency import check_replicas
from .dist.mesh import Mesh
from .engine import StagedEngine, build_engine, division_applies
from .errors import DistzoError
from .jsonl import JsonlWriter, truncate_after
from .metrics import MetricsWriter, Progress, format_duration, peak_memory_bytes, peak_rss_bytes
from . import native
from .models import adapter_for, load_model
from .objectives import accuracy_counts, cross_entropy_sums, objective_sums
from .peft import apply_peft
from .sinks import open_sinks
from .zo.directions import DIRECTIONS_VERSION, Directions, same_directions
from .zo.estimators import Estimator, build_estimator
from .zo.params import TrainableParams
from .zo.schedule import learning_rate
from .zo.subspace import ActivationCapture, SubspaceDirections

log = logging.getLogger("distzo")


class TrainingError(DistzoError):
    """Training cannot continue; the message says why and what to change."""


@dataclass
class Components:
    """What any run of a configuration needs, built once (training, benchmarking)."""

    cfg: Any
    mesh: Mesh
    seed: int
    model: torch.nn.Module
    tokenizer: Any
    task: ClassificationTask
    params: TrainableParams
    engine: StagedEngine
    estimator: Estimator
    sampler: TrainSampler
    capture: ActivationCapture | None = None  # AGZO: the clean forward's activation bases


@dataclass
class Run(Components):
    """A training run: the components plus its directory, logs and resume point."""

    run_dir: Path = Path(".")
    start_step: int = 0  # updates already done (0, or the resumed snapshot's step)
    nonfinite_in_a_row: int = 0  # consecutive skipped steps before start_step
    metrics: MetricsWriter | None = None
    trajectory: JsonlWriter | None = None


@dataclass
class StepOutcome:
    batch: Any  # the global batch
    losses: torch.Tensor  # mean loss of every evaluation over the global batch
    result: Any  # the estimator's StepResult, or None when the step was skipped
    lr: float


def build_components(cfg, mesh: Mesh, seed: int, snapshot: Path | None = None) -> tuple[Components, int]:
    """Model, task, trainable set, engine, estimator and sampler; loads a snapshot's weights when
    given one. Returns the components and the snapshot's step (0 without one)."""
    kernels = native.load(cfg.engine.native, mesh.device)  # None: torch ops (same values); first, it may fail
    model, tokenizer = load_model(cfg.model)
    task = ClassificationTask(cfg.task, tokenizer)
    est = cfg.estimator
    apply_peft(model, cfg.peft)  # freezes the model and adds the adapter's parameters (peft != none)
    if est.name == "agzo" and est.agzo.tied_embeddings == "freeze":
        freeze_tied_embeddings(model)
    params = TrainableParams.from_model(model)
    if len(params) == 0:
        raise TrainingError("nothing to train: every parameter is frozen (check peft and estimator.agzo.tied_embeddings)")
    step = load_snapshot_into(params, snapshot) if snapshot is not None else 0
    agzo = est.name == "agzo"
    directions = (SubspaceDirections if agzo else Directions)(seed, est.distribution, mesh.device, kernels=kernels)
    estimator = build_estimator(est)
    divide = work_division(cfg, mesh, estimator)
    engine = build_engine(cfg, model, adapter_for(model), params, directions, mesh.node, divide)  # places the model
    if estimator.batched:
        engine.stacked_lora = "materialize" if est.prge.materialize else "on_the_fly"
    capture = ActivationCapture(model, params, directions, est.agzo.rank, est.agzo.power_iters) if agzo else None
    return Components(cfg, mesh, seed, model, tokenizer, task, params, engine, estimator,
                      TrainSampler(task.size("train"), cfg.batch_size, seed), capture), step


def freeze_tied_embeddings(model: torch.nn.Module) -> None:
    """AGZO's tied-embedding policy `freeze`: a token embedding that is also the LM head trains
    neither as a table (dense noise over every row would swamp the subspace directions' advantage)
    nor as a linear layer (the head is read by label rows, so it has no input activations here)."""
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if head is not None and embed is not None and head.weight is embed.weight:
        embed.weight.requires_grad_(False)


def valid_tokens(batch, row_tokens: int) -> torch.Tensor:
    """[rows, cols] bool: True at the real tokens of the packed batch (row tails are padding)."""
    packed = batch.pack(row_tokens)
    rows, cols = packed.input_ids.shape
    ends = torch.zeros(rows, dtype=torch.long).scatter_reduce(0, packed.last_row, packed.last_col + 1, "amax")
    return torch.arange(cols)[None, :] < ends[:, None]


def work_division(cfg, mesh: Mesh, estimator: Estimator) -> bool:
    """Whether the node's ranks share the master and divide noise and update work (engine.divide_work)."""
    mode = str(cfg.engine.divide_work).lower()
    if mode == "false":
        return False
    why = None
    if not mesh.node.shared:
        why = "this process has no peers on its machine"
    elif mesh.device.type != "cpu":
        why = "it divides host-side work (CPU runs only)"
    elif cfg.offload.mode != "none":
        why = "offloaded runs divide the update by slices already (comm.sliced)"
    elif cfg.estimator.name != "mezo" or cfg.peft.method != "none":
        why = "it serves full-parameter estimator=mezo (other estimators and trainable sets evaluate their own way)"
    elif not division_applies(estimator.plan(), mesh.shape.pert):
        why = f"a perturbation rank of mesh {mesh.shape} would have no perturbed evaluation in the estimator's plan"
    if why is not None and mode == "true":
        raise TrainingError(f"engine.divide_work=true cannot apply: {why}; use engine.divide_work=auto")
    return why is None


def zo_step(c: Components, step: int) -> StepOutcome:
    """One ZO-SGD step on the mesh (DESIGN §2); every rank returns the same outcome."""
    cfg, mesh, engine = c.cfg, c.mesh, c.engine
    batch = c.task.batch("train", c.sampler.indices(step))                   # the global batch
    shard = batch.shard(mesh.data_rank, mesh.shape.data)                      # my data shard
    plan = c.estimator.plan()                                                  # every forward
    shared = [i for i, ev in enumerate(plan) if c.estimator.shared_clean and not ev.perturbed]
    dealt = [i for i in range(len(plan)) if i not in shared]
    mine = [dealt[j] for j in mesh.my_evaluations(len(dealt))]                 # dealt over P
    local = torch.zeros(len(plan), 2, dtype=torch.float64)
    if shared:                                                                 # AGZO: every rank, global batch
        with c.capture.capture(step, valid_tokens(batch, engine.row_tokens)):  # -> the step's bases
            logits = engine.label_logits(batch, c.task.label_ids, [plan[i] for i in shared], step, 0.0)
        if mesh.rank == 0:                                                     # counted once in the exchange
            local[shared] = objective_sums(logits.cpu(), batch.labels, cfg.objective)
    if mine or engine.collective_blocks:                                       # (sliced: walk with peers)
        node_plan = [plan[dealt[j]] for j in mesh.node_evaluations(len(dealt))]  # (work division)
        logits = engine.label_logits(shard, c.task.label_ids, [plan[i] for i in mine], step, c.estimator.eps,
                                     node_plan=node_plan)
        local[mine] = objective_sums(logits.cpu(), shard.labels, cfg.objective)  # (loss sum, count)
    with engine.timers("comm"):
        sums = mesh.exchange(local)                                            # global, on every rank
    losses = sums[:, 0] / sums[:, 1]
    lr = learning_rate(step, cfg.optim.lr, cfg.steps, cfg.optim.schedule, cfg.optim.warmup_steps)
    if not torch.isfinite(losses).all():                                       # skip, never update
        return StepOutcome(batch, losses, None, lr)
    result = c.estimator.combine(losses)                                       # projected gradients
    engine.update(step, result.coefficients, lr, cfg.optim.weight_decay)     # same on every rank
    return StepOutcome(batch, losses, result, lr)


_DEFAULT_THREADS = torch.get_num_threads()


def device_kind(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("device=cuda but no CUDA device is visible; use device=cpu or device=auto")
    return name


def config_fingerprint(cfg) -> str:
    """What a snapshot must agree with to be resumed: everything that shapes the trajectory except
    the mesh, offloading, threads and evaluation cadence (those change where and how fast, not what)."""
    keys = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "task", "estimator", "optim", "peft")}
    keys["batch_size"] = cfg.batch_size
    keys["objective"] = cfg.objective
    if cfg.optim.schedule != "constant":
        keys["steps"] = cfg.steps  # a decaying schedule depends on the run length
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def prepare_run_dir(run_dir: Path, resume: str) -> None:
    """Never mix two runs in one directory: a used directory is refused unless resuming."""
    used = (run_dir / "metrics.jsonl").exists()
    if used and resume == "never":
        raise TrainingError(f"{run_dir} already holds a run (metrics.jsonl); choose another hydra.run.dir "
                            "or add resume=auto to continue it")


def find_resume_point(cfg, run_dir: Path, mesh: Mesh):
    """Rank 0 picks the newest valid snapshot (resume=auto) and every rank loads it."""
    found = None
    if cfg.resume == "auto" and mesh.is_main:
        for stale in snapshots_dir(run_dir).glob(".step-*.tmp-*"):  # a snapshot whose writer died
            log.warning("Removing an unfinished snapshot %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        newest = newest_valid_snapshot(run_dir)
        if newest is not None:
            path, _, state = newest
            found = (str(path), state)
        elif (run_dir / "metrics.jsonl").exists():
            log.warning("resume=auto: %s has no valid snapshot; starting over (earlier logs set aside)", run_dir)
            for name in ("metrics.jsonl", "trajectory.jsonl"):
                if (run_dir / name).exists():
                    (run_dir / name).rename(run_dir / f"{name}.abandoned-{int(time.time())}")
    return mesh.broadcast_object(found)


def build_run(cfg, run_dir: Path, mesh: Mesh) -> Run:
    # Set (or restore) per run: a sweep runs several jobs in one process.
    torch.set_num_threads(cfg.threads or _DEFAULT_THREADS)
    resume = find_resume_point(cfg, run_dir, mesh)
    if resume is not None:
        _, state = resume
        if state["config_fingerprint"] != config_fingerprint(cfg):
            raise TrainingError(f"cannot resume from {resume[0]}: it was written with a different model, task, "
                                "estimator, optimiser, trainable set (peft), objective or batch size (or steps, with a "
                                "decaying lr schedule); use another hydra.run.dir to start afresh")
        if not same_directions(state.get("directions_version"), cfg.estimator.distribution):
            raise TrainingError(f"cannot resume from {resume[0]}: its {cfg.estimator.distribution} directions were "
                                f"drawn with scheme {state.get('directions_version')}, and this distzo draws scheme "
                                f"{DIRECTIONS_VERSION}; finish that run with the distzo version that started it, or "
                                "use another hydra.run.dir to start afresh")
        if cfg.seed is not None and cfg.seed != state["seed"]:
            raise TrainingError(f"cannot resume from {resume[0]}: it used seed {state['seed']}, not seed={cfg.seed}")
        seed = state["seed"]
    else:
        # Rank 0 fixes the run seed (the configured one, or one it draws); every direction derives from it.
        seed = mesh.broadcast_object(cfg.seed if cfg.seed is not None else secrets.randbits(63))
    c, start_step = build_components(cfg, mesh, seed, Path(resume[0]) if resume is not None else None)
    nonfinite = int(resume[1].get("nonfinite_in_a_row", 0)) if resume is not None else 0
    task, params, estimator = c.task, c.params, c.estimator
    if mesh.is_main and resume is not None:
        for name in ("metrics.jsonl", "trajectory.jsonl"):
            truncate_after(run_dir / name, start_step)  # the killed run's steps after the snapshot
    sinks = open_sinks(cfg, run_dir, {"world_size": mesh.world_size, "pert": mesh.shape.pert, "data": mesh.shape.data,
                                      "nodes": mesh.world_size // mesh.node.size, "seed": seed}) if mesh.is_main else []
    metrics = MetricsWriter(run_dir / "metrics.jsonl" if mesh.is_main else None, static={"mesh": str(mesh.shape)},
                            sinks=sinks)
    trajectory = JsonlWriter(run_dir / "trajectory.jsonl" if mesh.is_main else None)
    n_evals = len(estimator.plan()) - (1 if estimator.shared_clean else 0)  # dealt over P (AGZO: not its clean one)
    log.info("Task %s: %d train / %d validation / %d test examples; label words %s",
             task.name, task.size("train"), task.size("validation"), task.size("test"), task.label_words)
    log.info("Training %.2fM parameters (peft=%s) with %s (q=%d, eps=%g, %s directions), seed %d, mesh %s "
             "(%d evaluations per step over %d perturbation ranks, batch %d over %d data ranks), %s, run dir %s",
             params.numel() / 1e6, cfg.peft.method, cfg.estimator.name, cfg.estimator.q, cfg.estimator.eps,
             cfg.estimator.distribution, seed, mesh.shape, n_evals, mesh.shape.pert, cfg.batch_size,
             mesh.shape.data, "blocks offloaded to host memory" if cfg.offload.mode == "cpu" else "resident",
             run_dir)
    if resume is not None:
        log.info("Resuming from %s at step %d of %d", resume[0], start_step, cfg.steps)
    if mesh.shape.pert > n_evals:
        log.warning("mesh P=%d exceeds the %d evaluations a step needs: %d perturbation ranks idle; raise "
                    "estimator.q to use them", mesh.shape.pert, n_evals, mesh.shape.pert - n_evals)
    return Run(**vars(c), run_dir=run_dir, start_step=start_step, nonfinite_in_a_row=nonfinite, metrics=metrics,
               trajectory=trajectory)


def load_snapshot_into(params: TrainableParams, path: Path) -> int:
    tensors, state = read_snapshot(path)  # verified again on every rank
    names = {p.name for p in params}
    if set(tensors) != names:
        raise TrainingError(f"{path} holds other parameters than this model trains "
                            f"(missing {sorted(names - set(tensors))[:3]}, extra {sorted(set(tensors) - names)[:3]})")
    with torch.no_grad():
        for p in params:
            p.tensor.copy_(tensors[p.name])
    return int(state["step"])


def snapshot(run: Run, step: int, nonfinite_in_a_row: int) -> None:
    """Flush deferred updates, then rank 0 writes the snapshot (every rank holds the same weights)."""
    run.engine.flush()
    if not run.mesh.is_main:
        return
    run.trajectory.sync()
    state = {"seed": run.seed, "directions_version": DIRECTIONS_VERSION,
             "distribution": run.cfg.estimator.distribution, "device_type": run.mesh.device.type,
             "mesh": str(run.mesh.shape), "config_fingerprint": config_fingerprint(run.cfg),
             "nonfinite_in_a_row": nonfinite_in_a_row, "pending_update": None}
    path = write_snapshot(run.run_dir, step, {p.name: p.tensor for p in run.params}, state, run.cfg.checkpoint.keep)
    log.info("Snapshot at step %d: %s", step, path)


def evaluate(run: Run, split: str, step: int) -> dict[str, float]:
    """Accuracy and mean cross-entropy of the master weights on a whole split, its batches dealt
    over all ranks."""
    start = time.time()
    mesh = run.mesh
    batches = list(run.task.batches(split, run.cfg.eval_batch_size))
    mine = batches[mesh.rank::mesh.world_size]
    run.engine.flush()  # on every rank: a sliced flush is collective, and some ranks may have no batch
    progress = Progress(f"eval {split}", len(batches), enabled=mesh.is_main)
    correct = seen = 0
    loss_sum = 0.0
    for i, batch in enumerate(mine):
        logits = run.engine.clean_label_logits(batch, run.task.label_ids).cpu()
        c, n = accuracy_counts(logits, batch.labels)
        correct, seen = correct + c, seen + n
        loss_sum += float(cross_entropy_sums(logits[None], batch.labels)[0, 0])
        progress.update(min(len(batches), (i + 1) * mesh.world_size))
    correct, seen, loss_sum = mesh.all_sum([correct, seen, loss_sum])
    result = {"accuracy": correct / seen, "loss": loss_sum / seen, "examples": int(seen)}
    run.metrics.write("eval", step=step, split=split, **result, eval_time_s=round(time.time() - start, 3))
    log.info("step %d: %s accuracy %.4f, loss %.4f (%d examples, %s)", step, split, result["accuracy"],
             result["loss"], seen, format_duration(time.time() - start))
    return result


def train(cfg, run_dir: Path) -> dict[str, Any]:
    mesh = Mesh.create(cfg.mesh, device_kind(cfg.device), cfg.dist_timeout_s)
    try:
        run_dir = Path(mesh.broadcast_object(str(run_dir)))  # rank 0's directory (see __main__)
        if mesh.is_main:
            prepare_run_dir(run_dir, cfg.resume)
        run = build_run(cfg, run_dir, mesh)
        try:
            return _train(run)
        finally:
            run.metrics.close()
            run.trajectory.close()
            run.engine.directions.close()
    finally:
        mesh.close()


def _train(run: Run) -> dict[str, Any]:
    cfg, mesh, run_dir = run.cfg, run.mesh, run.run_dir
    first = last = evaluate(run, "validation", 0) if run.start_step == 0 else None
    progress = Progress("train step", cfg.steps, every_s=15.0, enabled=mesh.is_main)
    wall_start, step_times, loss_ema, nonfinite = time.time(), [], None, run.nonfinite_in_a_row
    offloaded = cfg.offload.mode != "none"
    for step in range(run.start_step, cfg.steps):
        moved_before = run.engine.transfer_stats()
        started = time.perf_counter()
        out = zo_step(run, step)                     # batch, plan, forwards, exchange, update (DESIGN §2)
        if out.result is None:                       # non-finite losses: skipped, weights unchanged
            nonfinite = skip_nonfinite_step(run, step, out.losses, nonfinite)
            continue
        nonfinite, result, lr, batch = 0, out.result, out.lr, out.batch
        step_time = time.perf_counter() - started
        step_times.append(step_time)

        run.trajectory.append({"step": step + 1, "update": step, "coefficients": [list(c) for c in result.coefficients],
                               "lr": lr, "weight_decay": cfg.optim.weight_decay, "grads": list(result.grads)})
        transfers = step_transfers(run, moved_before) if offloaded else {}
        run.metrics.write("train", step=step + 1, loss=result.loss, projected_grad=result.grads[0],
                          projected_grads=list(result.grads), lr=lr, tokens=batch.tokens,
                          step_time_s=round(step_time, 4), tokens_per_s=round(batch.tokens / step_time, 1),
                          **transfers, peak_mem_bytes=peak_memory_bytes(mesh.device))
        loss_ema = result.loss if loss_ema is None else 0.9 * loss_ema + 0.1 * result.loss
        progress.update(step + 1, f"loss {loss_ema:.4f} lr {lr:.2e} {step_time:.2f}s/step",
                        force=(step + 1) % cfg.log_every == 0)
        if cfg.replica_check_every and (step + 1) % cfg.replica_check_every == 0 and step + 1 < cfg.steps:
            run.engine.flush()  # compare current masters (flushing early changes no value)
            check_replicas(mesh, run.params, step + 1)
        if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
            snapshot(run, step + 1, nonfinite)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            last = evaluate(run, "validation", step + 1)

    run.engine.flush()  # deferred updates reach the master weights before they are checked or saved
    replica_checksums = check_replicas(mesh, run.params, cfg.steps)
    if cfg.checkpoint.every and cfg.steps % cfg.checkpoint.every and cfg.steps > run.start_step:
        snapshot(run, cfg.steps, nonfinite)  # the end of the run, if not on the cadence
    last = evaluate(run, "validation", cfg.steps)
    test = evaluate(run, "test", cfg.steps)
    summary = {
        "steps": cfg.steps, "resumed_from_step": run.start_step, "seed": run.seed, "mesh": str(mesh.shape),
        "directions_version": DIRECTIONS_VERSION,
        "validation_accuracy_before": first["accuracy"] if first else None,
        "validation_accuracy_after": last["accuracy"], "test_accuracy": test["accuracy"],
        "train_time_s": round(sum(step_times), 1),
        "step_time_s": round(statistics.median(step_times), 3) if step_times else math.nan,
        "wall_time_s": round(time.time() - wall_start, 1),
        "peak_rss_bytes": peak_rss_bytes(), "peak_mem_bytes": peak_memory_bytes(mesh.device),
        "trainable_parameters": run.params.numel(), "offload": cfg.offload.mode,
        **host_master_summary(run), "work_divided": run.engine.division is not None,
        "replica_checksums": replica_checksums,  # every rank's, in rank order: identical (checked)
    }
    if mesh.is_main:
        if cfg.save_final:
            path = save_final(run.model, run.tokenizer, run_dir / "final", run.params, cfg)
            summary["final_weights"] = str(path)
            log.info("Saved trained weights to %s", path)
        atomic_write_json(run_dir / "summary.json", summary)
    run.metrics.write("summary", **summary)
    before = f"{first['accuracy']:.4f}" if first else f"(resumed at step {run.start_step})"
    log.info("Validation accuracy %s -> %.4f after %d steps (%s training, median %.2f s/step); test accuracy %.4f",
             before, last["accuracy"], cfg.steps, format_duration(summary["train_time_s"]),
             summary["step_time_s"] if step_times else float("nan"), test["accuracy"])
    return summary


def host_master_summary(run: Run) -> dict[str, Any]:
    """The offloaded master's host memory: one copy's size, and what the node holds resident of it
    (summed over the node's ranks: one copy when node-shared, one per rank when not)."""
    if run.cfg.offload.mode == "none":
        return {}
    mem = run.engine.host_master_bytes()
    (node_resident,) = run.mesh.node.all_sum([mem["resident"]])
    return {"host_master_copy_bytes": mem["copy"], "host_master_node_bytes": int(node_resident),
            "node_ranks": run.mesh.node.size, "comm_sliced": bool(getattr(run.engine, "sliced", False))}


def step_transfers(run: Run, before: dict[str, float]) -> dict[str, Any]:
    """This step's offloading traffic: this rank's bytes per link and transfer time, and the bytes
    its whole node moved over the host link (one collective over the node's ranks)."""
    now = run.engine.transfer_stats()
    mine = {k: now[k] - before[k] for k in now}
    h2d_node, d2h_node = run.mesh.node.all_sum([mine["h2d_bytes"], mine["d2h_bytes"]])
    return {"h2d_bytes_per_rank": int(mine["h2d_bytes"]), "d2h_bytes_per_rank": int(mine["d2h_bytes"]),
            "peer_bytes_per_rank": int(mine["peer_bytes"]), "h2d_bytes_node": int(h2d_node),
            "d2h_bytes_node": int(d2h_node), "transfer_s": round(mine["transfer_s"], 4)}


def skip_nonfinite_step(run: Run, step: int, losses: torch.Tensor, in_a_row: int) -> int:
    """A step whose losses are not finite changes nothing; too many in a row stop the run with a
    valid snapshot of the (unchanged) weights."""
    in_a_row += 1
    cfg = run.cfg
    run.metrics.write("train", step=step + 1, skipped=True, losses=[float(x) for x in losses])
    run.trajectory.append({"step": step + 1, "update": step, "skipped": True})
    log.warning("step %d: non-finite loss %s; step skipped (%d in a row, limit %d)", step + 1,
                [float(x) for x in losses], in_a_row, cfg.max_nonfinite_steps)
    if in_a_row >= cfg.max_nonfinite_steps:
        if cfg.checkpoint.every:
            snapshot(run, step + 1, in_a_row)
        raise TrainingError(f"{in_a_row} steps in a row had non-finite losses (last at step {step + 1}); the weights "
                            f"were left unchanged{' and snapshotted' if cfg.checkpoint.every else ''}. Lower optim.lr "
                            f"(now {cfg.optim.lr:g}) or estimator.eps (now {cfg.estimator.eps:g}), then resume=auto")
    return in_a_row
