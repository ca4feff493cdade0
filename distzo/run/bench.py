"""`python -m distzo bench`: what a ZO step costs next to its forward passes, measured in one run.

Three measurements on the same model and the same batches, in this order:

1. **inference alone**: the forward passes a step needs (one per probe this rank runs) at the
   master weights, nothing else. Its peak memory is the baseline for training's.
2. **training**: the configured ZO step (any estimator, mesh, offloading), with the time split into
   noise generation, building perturbed copies, forward, update, waits for the node's peers (work
   division), communication and transfers. On CPU, drawing z shares its work items with the copies
   and the update; its part is apportioned by thread time (`timing.WorkClock`). On CUDA z is drawn
   asynchronously inside `perturb` and `noise` is not reported.
3. **one rank alone** (under torchrun, `bench.single_rank`): rank 0 runs a 1x1 copy of the same
   training, with the same threads, while its peers wait asleep in a collective. It gives the
   mesh's throughput against one rank as a ratio taken in the same run.
4. **MeZO with sgd beside another estimator or optimizer** (`estimator` other than mezo, or `optim`
   other than sgd): the same run with `estimator=mezo` (the run's eps, q, difference and
   distribution) and `optim=sgd`, built on the same mesh after the configured run's peak memory was
   taken (it holds a second copy of the model), its steps timed in the same rounds on the same
   batches, so the step's cost over the baseline's is a ratio taken in one run, also per forward
   pass where the estimator's plan has another number of them; with the optimizer's and the
   directions' state bytes. Peak memory beside the baseline's comes from bench runs of their own
   (`benchmarks/optimizer_cost.py`, `benchmarks/estimator_cost.py`), since a process's peak cannot
   be split between two models it holds.
5. **the MeZO reference** (one process only): the paper's Algorithm 1 as published: the global RNG
   re-seeded before each of four passes over the parameters (perturb +eps, perturb -2 eps,
   restore +eps, update), z drawn per parameter with `torch.normal`, parameters changed in place
   (`p.add_(z, alpha=...)`, the paper's in-place update; its code's `p.data = p.data + s * z * eps`
   allocates three temporaries and is about twice as slow here, so it would flatter distzo), losses
   from the stock model forward on right-padded batches with the full vocabulary head (MeZO's
   label-word loss for classification, transformers' token loss for language modelling).

Beside the times: tokens/s, the model FLOPs utilisation (`distzo.telemetry.flops`: 2 x parameters x
tokens x forward passes against the card's dense peak), the device's and the host's peak memory
(the host's while loading and while training), and the bytes streamed to the device a step.
`bench.profile` adds a torch.profiler table of two more steps (profile.txt, and profile-trace.json.gz
for chrome://tracing or Perfetto) and the device time by kind of kernel in bench.json.

The forward passes alone, the training step, the step on one rank alone, sgd's step and the
reference's step are timed in interleaved rounds on the same batch (a shared machine's speed drifts over minutes).
Every figure is a median over the rounds, every ratio the median of the rounds' ratios, all within
this one invocation.
"""

from __future__ import annotations

import collections
import gzip
import logging
import os
import re
import shutil
import statistics
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch.nn import functional as F

from ..config.compose import switch_component, typed
from ..config.schema import Config, switch
from ..models.quantize import base_matmul
from ..parallel.mesh import Mesh
from ..parallel.shape import MeshShape
from ..state.snapshots import atomic_write_json
from ..telemetry.flops import forward_precision, model_flops_utilisation
from ..telemetry.metrics import host_memory_bytes, peak_memory_bytes, reset_host_peak, reset_peak_memory
from ..telemetry.timing import Timers, WorkClock
from ..zo.estimators import CLEAN, SPSA, Probe
from ..zo.optimizers import SGD
from ..zo.reference import mezo_step
from .checks import validate
from .components import Components, build_components
from .rundir import RunDirectory
from .session import Session
from .training import zo_step

log = logging.getLogger("distzo")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def forward_baseline(c: Components, steps: range) -> list[float]:
    """Seconds per step of the forward passes alone: as many clean probes as the step deals this
    rank, on the same shards (a rank dealt none still walks the blocks where its peers need it to)."""
    mesh, times = c.mesh, []
    clean = [Probe(CLEAN, 0)] * len(c.estimator.dealt_plan())
    for step in steps:
        shard = c.task.train_batch(c.sampler.indices(step)).shard(mesh.data_rank, mesh.shape.data)
        started = time.perf_counter()
        c.engine.run_probes(shard, clean, step)
        if mesh.device.type == "cuda":
            torch.cuda.synchronize(mesh.device)
        times.append(time.perf_counter() - started)
    mesh.barrier()  # every rank has read the (node-shared) master before a training step changes it
    return times


def training_steps(c: Components, steps: range) -> tuple[list[float], list[dict[str, float]]]:
    times, phases = [], []
    c.timers.take()
    for step in steps:
        started = time.perf_counter()
        zo_step(c, step)
        if c.mesh.device.type == "cuda":
            torch.cuda.synchronize(c.mesh.device)
        times.append(time.perf_counter() - started)
        phases.append(c.timers.take())
    return times, phases


def reference_supported(c: Components) -> bool:
    """Whether MeZO's reference can score the task: the label-word head of MeZO's classification
    tasks, or the token loss of plain sequences (language modelling, teacher forcing without branches)."""
    if c.task.label_ids is not None:
        return True
    batch = c.task.train_batch(c.sampler.indices(0))
    return batch.readout == "tokens" and not any(s.branches for s in batch.sequences)


def reference_loss(c: Components, step: int):
    """The loss MeZO's code computes on the step's batch, from the stock model forward on right-padded
    sequences with the whole vocabulary head: the label words' cross-entropy at each prompt's last
    token (classification), or transformers' token loss (`labels`, the positions each sequence scores)."""
    model, device = c.model, c.mesh.device
    batch = c.task.train_batch(c.sampler.indices(step))
    seqs = [torch.tensor(s.tokens) for s in batch.sequences]
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=c.task.pad_id).to(device)
    mask = (torch.arange(ids.shape[1])[None] < torch.tensor([len(p) for p in seqs])[:, None]).to(device)
    if c.task.label_ids is not None:
        label_ids = c.task.label_ids.to(device)
        last = torch.tensor([len(p) - 1 for p in seqs], device=device)
        labels = batch.labels.to(device)

        @torch.inference_mode()
        def loss() -> float:
            logits = model(input_ids=ids, attention_mask=mask).logits  # every position, the whole vocabulary
            return float(F.cross_entropy(logits[torch.arange(ids.shape[0]), last][:, label_ids].float(), labels))
        return loss
    targets = torch.full(ids.shape, -100, dtype=torch.long)
    for row, s in enumerate(batch.sequences):  # position p scores token p + 1 (transformers shifts labels)
        targets[row, [p + 1 for p in s.scored]] = torch.tensor(s.targets)
    targets = targets.to(device)

    @torch.inference_mode()
    def token_loss() -> float:
        return float(model(input_ids=ids, attention_mask=mask, labels=targets).loss)
    return token_loss


def mezo_reference_steps(c: Components, steps: range, lr: float, eps: float) -> list[float]:
    """MeZO's Algorithm 1 as published (`distzo.zo.reference`) on the run's batches, with MeZO's
    loss (`reference_loss`); changes the model's weights."""
    params = [p for _, p in c.model.named_parameters() if p.requires_grad]
    times = []
    for step in steps:
        loss = reference_loss(c, step)
        started = time.perf_counter()
        mezo_step(params, loss, lr, eps, seed=int(torch.randint(0, 10**9, (1,))))
        if c.mesh.device.type == "cuda":
            torch.cuda.synchronize(c.mesh.device)
        times.append(time.perf_counter() - started)
    return times


# Kinds of kernel (or, on CPU, of operator) for a profile's time budget; the first pattern that
# matches a name wins, the rest is "other".
KERNEL_KINDS = (
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matmul", r"gemm|gemv|matmul|aten::mm$|aten::addmm|aten::bmm|aten::linear|cutlass|xmma|cublas|nvjet"),
    ("noise", r"_draw_kernel|normal|randn|rademacher|bernoulli|philox"),
    ("perturb", r"_chunk_kernel"),  # CUDA: the pending update and the working copies, z drawn in the kernel
    # distzo's decode kernels (engine.quantized_matmul=decoded); torchao's own decoding runs as generic
    # elementwise and copy kernels, which count under copy and other
    ("decode", r"_int8_kernel|_nf4_kernel|dequantize"),
    ("copy", r"memcpy|memset|copy|aten::to$|_to_copy|aten::cat"),
)


def profile_steps(c: Components, steps: list[int], run_dir: Path) -> dict[str, Any]:
    """torch.profiler over `steps` (uninstrumented, as the timed steps): the table of the operators
    and kernels by self time in run_dir/profile.txt, the trace in profile-trace.json.gz, and the
    device's time by kind of kernel (on CPU the operators' self time), and the kernels' time over the
    wall time (streams overlap: copies beside compute can take it past 1)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = c.mesh.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    started = time.perf_counter()
    with c.timers.paused() if cuda else nullcontext(), profile(activities=activities) as prof:
        training_steps(c, steps)
    wall_us = (time.perf_counter() - started) * 1e6
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    # On CUDA only the kernels (and device copies) themselves: an operator's row carries the device
    # time of the kernels it launched as its own "self" time too, so summing both counted it twice.
    events = [e for e in prof.key_averages() if getattr(e, key) > 0
              and (not cuda or e.device_type == torch.autograd.DeviceType.CUDA)]
    budget = dict.fromkeys([k for k, _ in KERNEL_KINDS] + ["other"], 0.0)
    for e in events:
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, e.key, re.IGNORECASE)), "other")
        budget[kind] += getattr(e, key)
    total = sum(budget.values())
    # The device's idle time: the wall time less the union of its kernels' and copies' intervals (where
    # the host, not the device, sets the pace; the profiler's own overhead counts as idle too).
    busy_us = _union_length([(e.time_range.start, e.time_range.end) for e in prof.events()
                             if e.device_type == torch.autograd.DeviceType.CUDA]) if cuda else None
    gaps = idle_gaps(prof.events(), len(steps)) if cuda else None
    if c.mesh.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "profile.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40) + "\n")
        trace = run_dir / "profile-trace.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
    top = sorted(events, key=lambda e: -getattr(e, key))[:15]
    return {"steps": len(steps), "time": "device kernels" if cuda else "operators' self CPU time",
            "seconds_per_step": round(total / 1e6 / len(steps), 4),
            "busy_fraction": round(total / wall_us, 3) if cuda else None,
            "device_idle_s": round(max(0.0, wall_us - busy_us) / 1e6 / len(steps), 4) if cuda else None,
            "by_kind_s": {k: round(v / 1e6 / len(steps), 4) for k, v in budget.items()},
            "idle_gaps": gaps,
            "top": [{"name": e.key, "calls": e.count // len(steps),
                     "seconds_per_step": round(getattr(e, key) / 1e6 / len(steps), 5)} for e in top]}


def idle_gaps(events, steps: int, min_us: float = 20.0, longest: int = 12) -> dict[str, Any]:
    """Where the device waited on the host: every gap of at least `min_us` in the union of the
    device's intervals (kernels and copies on any stream), a step's count and seconds of them, and
    the `longest` gaps, each with the kernels before and after it and the host operators that ran
    during it on the main thread (each operator's own time in the gap, less what ran nested in it,
    in microseconds; `python` is the part no operator covers: the interpreter's own work). A gap
    after a synchronising operator (`aten::item`, `aten::nonzero`, `aten::unique`,
    `cudaStreamSynchronize`) is the host's latency, paid once per synchronisation."""
    device = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    found, reach, last = [], None, None
    for start, end, name in device:
        if reach is not None and start - reach >= min_us:
            found.append((reach, start, last, name))
        if reach is None or end > reach:
            reach, last = end, name
    found.sort(key=lambda g: g[0] - g[1])
    host = [(e.time_range.start, e.time_range.end, e.name, e.thread) for e in events
            if e.device_type == torch.autograd.DeviceType.CPU]
    main = collections.Counter(t for *_, t in host).most_common(1)[0][0] if host else None
    host = sorted(((s, e, n) for s, e, n, t in host if t == main), key=lambda x: (x[0], -x[1]))
    top = []
    for gap_start, gap_end, before, after in found[:longest]:
        ops = [(max(s, gap_start), min(e, gap_end), n) for s, e, n in host if s < gap_end and e > gap_start]
        share: dict[str, float] = {}
        for i, (s, e, n) in enumerate(ops):  # an operator's own time in the gap: less what runs nested in it
            nested = []
            for s2, e2, _ in ops[i + 1:]:
                if s2 >= e:
                    break
                nested.append((s2, min(e2, e)))
            share[n] = share.get(n, 0.0) + (e - s) - _union_length(nested)
        share["python"] = (gap_end - gap_start) - _union_length([(s, e) for s, e, _ in ops])
        host_ops = sorted(((n, round(us)) for n, us in share.items() if us >= 1), key=lambda x: -x[1])[:4]
        top.append({"us": round(gap_end - gap_start), "after": before[:80], "before": after[:80], "host": host_ops})
    return {"min_us": min_us, "per_step": round(len(found) / steps, 1),
            "seconds_per_step": round(sum(e - s for s, e, _, _ in found) / 1e6 / steps, 6), "longest": top}


def _union_length(spans: list[tuple[float, float]]) -> float:
    """The total length covered by intervals [start, end) that may overlap."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def candidate_scoring_rounds(c: Components, rounds: int) -> dict[str, Any] | None:
    """Shared-prompt candidate scoring against one full sequence per candidate: the clean scores of
    the same validation batches both ways, in interleaved rounds (None when the task's batches have
    no candidates after a shared prompt)."""
    batches = list(c.task.batches("validation", c.cfg.eval_batch_size))[:4]
    if not batches or not any(s.branches for s in batches[0].sequences):
        return None
    shared_s, full_s = [], []
    with c.engine.materialized() as weights:
        for b in batches:  # warm-up
            weights.score(b)
            weights.score(b.unbranched())
        for _ in range(rounds):
            for times, make in ((shared_s, lambda b: b), (full_s, lambda b: b.unbranched())):
                started = time.perf_counter()
                for b in batches:
                    weights.score(make(b))
                if c.mesh.device.type == "cuda":
                    torch.cuda.synchronize(c.mesh.device)
                times.append(time.perf_counter() - started)
    examples = sum(b.size for b in batches)
    candidates = sum(b.units for b in batches) / examples
    tokens = sum(b.tokens for b in batches), sum(b.unbranched().tokens for b in batches)
    return {"examples": examples, "candidates_per_example": round(candidates, 2),
            "tokens_shared": tokens[0], "tokens_one_sequence_each": tokens[1],
            "shared_prompt_s": round(_median(shared_s), 4), "one_sequence_each_s": round(_median(full_s), 4),
            "speedup": round(_median([f / s for f, s in zip(full_s, shared_s)]), 3)}


def materialize(c: Components) -> None:
    """Apply whatever update the engine still awaits (every rank, together)."""
    with c.engine.materialized():
        pass


def wants_single_rank(cfg: Config, mesh: Mesh) -> bool:
    mode = switch(cfg.bench.single_rank)
    if mesh.world_size == 1 and mode == "true":
        log.info("bench.single_rank=true: this run is one rank already; its figures are one rank's")
    if mesh.world_size == 1 or mode == "false":
        return False
    return mode == "true" or (mesh.device.type == "cpu" and mesh.node.size == mesh.world_size)


def single_rank_components(c: Components) -> Components | None:
    """On rank 0: the same run on a 1x1 mesh of its own (no peers, no work division), for timing one
    rank alone; None on the other ranks. Collective: every rank calls it, the others wait."""
    solo = None
    if c.mesh.is_main:
        cfg = replace(c.cfg, mesh="1x1", engine=replace(c.cfg.engine, divide_work="false"))
        solo = build_components(cfg, Mesh(MeshShape.parse("1x1"), c.mesh.device), c.seed, sources=c.sources)
    c.mesh.barrier()  # the peers wait until rank 0 has built it
    return solo


def single_rank_round(solo: Components | None, mesh: Mesh, untimed: int, step: int) -> float | None:
    """Rank 0 runs an untimed and a timed step of the 1x1 copy (the timed one applies the untimed one's
    update, fused, as in the mesh's rounds) while the other ranks wait in a collective; gloo waits
    without spinning, so the timed rank has the machine to itself. Seconds of the timed step, on rank 0."""
    seconds = None
    if solo is not None:
        training_steps(solo, [untimed])
        seconds = training_steps(solo, [step])[0][0]
    mesh.barrier()
    return seconds


def baseline_components(c: Components) -> Components:
    """The same run with estimator=mezo and optim=sgd (keeping the settings every estimator and every
    optimizer has), on the same mesh (every rank builds it, as the run's)."""
    cfg = replace(c.cfg, estimator=switch_component(c.cfg.estimator, "estimator", "mezo"),
                  optim=switch_component(c.cfg.optim, "optimizer", "sgd"))
    baseline = build_components(cfg, c.mesh, c.seed, sources=c.sources)
    c.mesh.barrier()
    return baseline


def is_baseline(c: Components) -> bool:
    """MeZO's SPSA with ZO-SGD: what other estimators and optimizers are timed beside."""
    return type(c.optimizer) is SGD and type(c.estimator) is SPSA


def bench(cfg: Config | DictConfig, run_dir: str | Path | RunDirectory | None = None, *,
          validate_config: bool = True) -> dict[str, Any]:
    """Time a ZO step of `cfg` against its forward passes (see the module docstring); writes
    bench.json in the run directory and prints the report (rank 0). Returns the figures."""
    cfg = typed(cfg)
    if validate_config:
        validate(cfg)
    session = Session(cfg, run_dir, resumable=False)  # a benchmark continues no run
    try:
        mesh = session.mesh
        clock = WorkClock() if mesh.device.type == "cpu" else None
        c = build_components(cfg, mesh, session.seed(), timers=Timers(True, mesh.device, clock), clock=clock)
        try:
            return _bench(cfg, c, session.run_dir)
        finally:
            c.close()
    finally:
        session.close()


def _bench(cfg: Config, c: Components, run_dir: Path) -> dict[str, Any]:
    b, mesh, device = cfg.bench, c.mesh, c.mesh.device
    warm = range(b.warmup)
    # Timed rounds, interleaved so that slow drift of a shared machine's speed hits both sides of a
    # ratio alike: round i times the forward passes alone and then a ZO step, on the same batch.
    # Each round's timed step follows an untimed one, so it applies the fused deferred update as every
    # step of a run does (the forwards alone must not include it: the engine is flushed before them).
    rounds = [(b.warmup + 2 * i, b.warmup + 2 * i + 1) for i in range(b.steps)]
    timed = [t for _, t in rounds]
    tokens = [c.task.train_batch(c.sampler.indices(s)).tokens for s in timed]
    log.info("bench: %d warm-up steps, then %d rounds of (forward passes alone, ZO step)", b.warmup, b.steps)

    host_load = host_memory_bytes()["peak"]  # loading's high-water mark: read before any reset clears it
    reset_peak_memory(device)
    forward_baseline(c, [*warm, *timed])
    inference_peak = peak_memory_bytes(device)  # on the timed batches, before training allocates anything
    clock = c.directions.clock

    reset_peak_memory(device)
    reset_host_peak()
    training_steps(c, warm)
    materialize(c)
    # The steady state: every buffer a step uses exists after the first step, and the second applies a
    # fused update. Taken before the single-rank copy (if any) adds a second model to rank 0.
    training_peak = peak_memory_bytes(device)
    host_training = host_memory_bytes()
    single = wants_single_rank(cfg, mesh)
    solo = single_rank_components(c) if single else None
    if single:
        log.info("bench: each round also times the step on rank 0 alone (bench.single_rank)")
        if solo is not None:
            training_steps(solo, warm)  # its own warm-up
        mesh.barrier()
    reference = (b.reference and mesh.world_size == 1 and cfg.offload.mode == "none"
                 and reference_supported(c))
    lr, eps = cfg.optim.lr, cfg.estimator.eps
    if reference:
        log.info("bench: each round also times a step of MeZO's Algorithm 1 (bench.reference)")
        mezo_reference_steps(c, warm, lr, eps)  # its own warm-up
    sgd = baseline_components(c) if not is_baseline(c) else None  # MeZO with ZO-SGD beside the run
    if sgd is not None:
        log.info("bench: each round also times the step with estimator=mezo optim=sgd (a second copy of the run)")
        training_steps(sgd, warm)  # its own warm-up
    # On CUDA the phase timers synchronise the device at every boundary, which would serialise the
    # streams whose overlap offloading relies on: there the timed step and the forwards alone run
    # uninstrumented (an offloaded OPT-6.7B's forwards took 0.632 s instrumented against a 0.595 s
    # step uninstrumented, H100) and the breakdown comes from the round's untimed step (the same
    # work: it applies a fused update too).
    cuda = device.type == "cuda"
    forward_times, step_times, phases, breakdown_times, solo_times, ref_times = [], [], [], [], [], []
    untimed_times: list[float] = []  # each round's untimed step (instrumented on CUDA), beside the timed one
    sgd_times: list[float] = []
    step_h2d: list[float] = []  # bytes this rank moved host-to-device in each timed step (offloading)
    for untimed, step in rounds:
        materialize(c)  # the forwards alone apply no pending update
        with c.timers.paused() if cuda else nullcontext():  # uninstrumented, as the timed step
            forward_times += forward_baseline(c, [step])
        t_untimed, p_untimed = training_steps(c, [untimed])
        moved = c.engine.transfer_stats().get("h2d_bytes", 0)
        with c.timers.paused() if cuda else nullcontext():
            t, p = training_steps(c, [step])
        step_h2d.append(c.engine.transfer_stats().get("h2d_bytes", 0) - moved)
        step_times += t
        untimed_times += t_untimed
        phases += p_untimed if cuda else p
        breakdown_times += t_untimed if cuda else t
        if single:
            solo_times.append(single_rank_round(solo, mesh, untimed, step))
        if sgd is not None:  # the same two steps with sgd: the timed one applies a fused deferred update too
            training_steps(sgd, [untimed])
            sgd_times += training_steps(sgd, [step])[0]
        if reference:
            materialize(c)  # the reference reads and changes the model's weights directly
            ref_times += mezo_reference_steps(c, [step], lr, eps)
    materialize(c)
    if sgd is not None:
        materialize(sgd)
    log.info("bench: forward passes alone %.3f s/step, ZO step %.3f s/step", _median(forward_times),
             _median(step_times))

    all_steps = mesh.all_gather_floats(step_times)  # the slowest rank sets the pace
    pace = [max(col) for col in zip(*all_steps)]
    step_time = _median(pace)
    forward_time = _median(forward_times)
    breakdown = {k: round(_median([p.get(k, 0.0) for p in phases]), 4)
                 for k in ("noise", "perturb", "update", "wait", "comm", "transfer")}
    breakdown["forward"] = round(max(0.0, _median([t - sum(p.values()) for t, p in zip(breakdown_times, phases)])), 4)
    if clock is None:
        breakdown["noise"] = None  # drawn on the device, asynchronously, inside perturb
    result: dict[str, Any] = {
        "model": cfg.model.name, "estimator": cfg.estimator.name, "q": cfg.estimator.q,
        "distribution": cfg.estimator.distribution, "mesh": str(mesh.shape), "offload": cfg.offload.mode,
        "dtype": str(cfg.model.dtype), "compute": str(cfg.engine.compute),
        "quantized_matmul": base_matmul(cfg.model.quantize, cfg.engine.quantized_matmul, device.type),
        "device": str(device.type), "threads_per_rank": torch.get_num_threads(), "batch_size": cfg.batch_size,
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "warmup_steps": b.warmup, "timed_steps": b.steps,
        "step_time_s": round(step_time, 4),
        "tokens_per_s": round(_median([t / s for t, s in zip(tokens, pace)]), 1),
        "forward_time_s": round(forward_time, 4),
        "overhead_ratio": round(_median([t / f for t, f in zip(step_times, forward_times)]), 3),
        "breakdown_s": breakdown,
        "peak_memory_bytes": {"inference": inference_peak, "training": training_peak},
        "memory_ratio": round(training_peak / inference_peak, 3) if inference_peak else None,
        "optimizer": optimizer_figures(c, step_times, sgd_times, forward_times),
        "estimator_cost": estimator_figures(c, sgd, step_times, sgd_times),
        "mfu": model_flops_utilisation(
            sum(p.numel() for p in c.model.parameters()), _median(tokens), len(c.estimator.plan()), step_time,
            mesh.world_size, torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            forward_precision(str(cfg.model.dtype), str(cfg.engine.compute)), b.peak_tflops),
        "host_memory_bytes": {"load_peak": host_load, "training_peak": host_training["peak"],
                              "training_now": host_training["now"]},
        "model_bytes": c.quantized.model_bytes,  # the base's parameters as stored
        "h2d_bytes_per_step": int(_median(step_h2d)),  # weights streamed to the device by one step (this rank)
        **c.quantized.summary(),
    }
    result["rounds"] = [  # this rank's (rank 0's) figures per round, for the spread behind each median
        {k: round(v, 9) for k, v in entry.items() if v is not None}
        for entry in ({"forward_s": f, "step_s": t, "pace_s": p, "untimed_step_s": untimed_times[i],
                       "single_rank_s": solo_times[i] if single else None,
                       "sgd_step_s": sgd_times[i] if sgd_times else None,
                       "reference_s": ref_times[i] if reference else None}
                      for i, (f, t, p) in enumerate(zip(forward_times, step_times, pace)))]
    if single and mesh.is_main:
        result["single_rank"] = {
            "step_time_s": round(_median(solo_times), 4),
            "tokens_per_s": round(_median([t / s for t, s in zip(tokens, solo_times)]), 1),
            # per round: the mesh's throughput over one rank's, on the same batch
            "throughput_ratio": round(_median([s / p for s, p in zip(solo_times, pace)]), 3),
        }
        log.info("bench: one rank alone %.3f s/step", result["single_rank"]["step_time_s"])
    if reference:
        per_round = [t / r for t, r in zip(step_times, ref_times)]  # on the same batch, in the same round
        ratio = _median(per_round)
        result["mezo_reference"] = {"step_time_s": round(_median(ref_times), 4),
                                    "distzo_over_reference": round(ratio, 3),
                                    "speedup": round(1 / ratio, 3)}  # the same figure inverted, even for even rounds
        log.info("bench: MeZO reference %.3f s/step", result["mezo_reference"]["step_time_s"])
    if sgd is not None:
        sgd.close()
    if b.profile:
        after = b.warmup + 2 * b.steps
        result["profile"] = profile_steps(c, [after, after + 1], run_dir)
        materialize(c)
        log.info("bench: profiled 2 steps: %s", ", ".join(f"{k} {v:.3f} s" for k, v in
                                                       result["profile"]["by_kind_s"].items()))
    scoring = candidate_scoring_rounds(c, b.steps)
    if scoring is not None:
        result["candidate_scoring"] = scoring
        log.info("bench: candidates after a shared prompt %.3f s, one sequence per candidate %.3f s",
                 scoring["shared_prompt_s"], scoring["one_sequence_each_s"])
    if mesh.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(run_dir / "bench.json", result)  # strict JSON, whole or not at all
        print(report(result))
    return result


def optimizer_figures(c: Components, step_times: list[float], sgd_times: list[float],
                      forward_times: list[float]) -> dict[str, Any]:
    """The optimizer, its state's bytes (one copy; this node's, summed over its ranks), and with sgd
    timed beside it: sgd's step, the step's ratio to sgd's and sgd's overhead ratio (medians of the
    rounds' ratios)."""
    copy, node = c.optimizer_memory()
    out: dict[str, Any] = {"name": c.optimizer.name, "state_bytes": copy, "state_node_bytes": node}
    if sgd_times:
        out.update({"sgd_step_time_s": round(_median(sgd_times), 4),
                    "step_over_sgd": round(_median([t / s for t, s in zip(step_times, sgd_times)]), 3),
                    "sgd_overhead_ratio": round(_median([s / f for s, f in zip(sgd_times, forward_times)]), 3)})
    return out


def estimator_figures(c: Components, baseline: Components | None, step_times: list[float],
                      baseline_times: list[float]) -> dict[str, Any]:
    """The estimator, its forward passes a step (the whole plan), its directions' state bytes (on
    this rank), and with MeZO timed beside it: MeZO's forward passes and step, and the step's ratio
    to MeZO's, as it is and per forward pass (medians of the rounds' ratios)."""
    passes = len(c.estimator.plan())
    out: dict[str, Any] = {"name": c.estimator.name, "forward_passes": passes,
                           "directions_state_bytes": c.directions.state_bytes(),
                           "directions_memory_bytes": c.directions.memory_bytes()}
    if baseline is not None and baseline_times:
        base = len(baseline.estimator.plan())
        ratio = _median([t / s for t, s in zip(step_times, baseline_times)])
        out.update({"mezo_forward_passes": base, "mezo_step_time_s": round(_median(baseline_times), 4),
                    "step_over_mezo": round(ratio, 3),
                    "step_over_mezo_per_forward": round(ratio * base / passes, 3)})
    return out


def report(r: dict[str, Any]) -> str:
    gib = 2**30
    lines = [
        f"distzo bench: {r['model']}, {r['estimator']} q={r['q']} ({r['distribution']}), mesh {r['mesh']}, "
        f"offload {r['offload']}, {r['device']} x {r['threads_per_rank']} thread(s)/rank, batch {r['batch_size']}",
        f"  step time          {r['step_time_s']:.3f} s   ({r['tokens_per_s']:.0f} tokens/s)",
        f"  forward passes     {r['forward_time_s']:.3f} s   overhead ratio {r['overhead_ratio']}",
        "  step breakdown     " + ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} (in perturb)"
                                            for k, v in r["breakdown_s"].items()),
        f"  peak memory        inference {r['peak_memory_bytes']['inference'] / gib:.2f} GiB, training "
        f"{r['peak_memory_bytes']['training'] / gib:.2f} GiB (x{r['memory_ratio']})",
    ]
    h = r.get("host_memory_bytes")
    if h and h.get("training_peak") is not None and r["device"] != "cpu":
        lines.append(f"  host memory        peak while loading {h['load_peak'] / gib:.2f} GiB, while training "
                     f"{h['training_peak'] / gib:.2f} GiB")
    m = r.get("mfu")
    if m:
        value = f"{m['value']:.1%} of {m['peak_tflops']:.0f} TFLOP/s ({m['precision']})" if m["value"] is not None \
            else "n/a (" + m["why_none"].split(":")[0] + ")"
        lines.append(f"  FLOPs              {m['achieved_tflops']} TFLOP/s achieved; MFU {value}")
    o = r.get("optimizer", {"name": "sgd", "state_bytes": 0})
    line = f"  optimizer          {o['name']}, state {o['state_bytes'] / gib:.3f} GiB"
    if "sgd_step_time_s" in o:
        line += (f"; MeZO with sgd: step {o['sgd_step_time_s']:.3f} s (overhead ratio {o['sgd_overhead_ratio']}), "
                 f"this step x{o['step_over_sgd']} its")
    lines.append(line)
    e = r.get("estimator_cost", {})
    if "mezo_step_time_s" in e:
        lines.append(f"  estimator          {e['name']}: {e['forward_passes']} forward passes a step (MeZO "
                     f"{e['mezo_forward_passes']}), directions' state {e['directions_state_bytes'] / gib:.4f} GiB "
                     f"(held with their factors: {e['directions_memory_bytes'] / gib:.4f} GiB); "
                     f"step x{e['step_over_mezo']} MeZO's, per forward pass x{e['step_over_mezo_per_forward']}")
    if r.get("h2d_bytes_per_step"):
        lines.append(f"  streamed           {r['h2d_bytes_per_step'] / gib:.3f} GiB host-to-device a step (this rank)")
    if "quantize" in r:
        lines.append(f"  quantized base     {r['quantize']}: {r['quantized_layers']} linear layers, "
                     f"{r['quantized_bytes'] / gib:.3f} GiB ({r['quantized_bytes_ratio']}x their float32 "
                     f"{r['quantized_float32_bytes'] / gib:.3f} GiB)")
    if "single_rank" in r:
        one = r["single_rank"]
        lines.append(f"  one rank alone     {one['step_time_s']:.3f} s   ({one['tokens_per_s']:.0f} tokens/s); mesh "
                     f"{r['mesh']} throughput {one['throughput_ratio']}x one rank's")
    if "candidate_scoring" in r:
        s = r["candidate_scoring"]
        lines.append(f"  candidate scoring  shared prompts {s['shared_prompt_s']:.3f} s, one sequence per candidate "
                     f"{s['one_sequence_each_s']:.3f} s ({s['speedup']}x; {s['examples']} examples, "
                     f"{s['candidates_per_example']} candidates each)")
    if "profile" in r:
        p = r["profile"]
        lines.append(f"  profile            {p['time']} {p['seconds_per_step']:.3f} s a step: " + ", ".join(
            f"{k} {v:.3f}" for k, v in p["by_kind_s"].items()) + (
            f"; kernel time / wall {p['busy_fraction']:.0%}, device idle {p['device_idle_s']:.3f} s a step"
            if p["busy_fraction"] is not None else ""))
        if p.get("idle_gaps"):
            g = p["idle_gaps"]
            lines.append(f"  idle gaps          {g['per_step']} a step of at least {g['min_us']:.0f} us, "
                         f"{g['seconds_per_step']:.4f} s a step; longest: " + "; ".join(
                             f"{x['us']} us before {x['before'][:40]} ({', '.join(n for n, _ in x['host'][:2])})"
                             for x in g["longest"][:3]))
    if "mezo_reference" in r:
        m = r["mezo_reference"]
        lines.append(f"  MeZO reference     {m['step_time_s']:.3f} s   distzo/reference {m['distzo_over_reference']} "
                     f"({m['speedup']}x faster)")
    return "\n".join(lines)
