"""Rebuild a run's weights at any logged step from a snapshot and the trajectory log (MeZO §2.1).

Each logged step carries what its update needs (coefficients c_k, lr, weight decay); with the run's
seed the directions z_k are regenerated, so the weights move exactly as they did in training, with
no data and no forward pass. Replay drives a resident engine through the interface training uses
(`apply`, then `materialized`), the same catch-up `resume=auto` runs, so on the same device type the
result is bitwise the trained weights.

An optimizer with state (momentum, adam) starts from the snapshot's state and updates it step by
step as training did. Its state is a function of the trajectory (zeros at step 0), so `--from-step 0`
rebuilds weights and state from the initial weights (a function of the configuration; `run.json`
holds the seed) and the whole trajectory, with no snapshot at all.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config.compose import typed
from ..errors import DistzoError
from ..parallel.mesh import Mesh
from ..state.resume import catch_up, drawn_by, snapshot_drawn_elsewhere
from ..state.saved import RUN_FILE, load_run_config
from ..state.snapshots import CorruptSnapshot, list_snapshots, read_optimizer_state, read_snapshot
from ..telemetry.jsonl import read_jsonl
from ..zo.directions import (
    DIRECTIONS_VERSION,
    gaussian_generator_id,
    same_directions,
)
from ..zo.estimators import estimator_type
from .components import build_model_stack
from .hub_pins import HubPins, fetch_hub_pins
from .rundir import writable_ancestor

log = logging.getLogger("distzo")


class ReplayError(DistzoError):
    pass


def replay(run_dir: Path, step: int | None = None, out: Path | None = None, device: str = "cpu",
           from_step: int | None = None, overwrite: bool = False) -> Path:
    """Write <out> (default <run_dir>/replay/step-NNNNNNNN.safetensors, replaced if there): the
    trainable weights after `step` updates (default: the last logged step), starting from the newest
    valid snapshot at or before `from_step` (default: at or before `step`). An `out` that exists is
    replaced only with `overwrite`, and never one of the run's own weights. Returns the written path."""
    run_dir = Path(run_dir)
    _check_device(device)
    if out is not None:
        _check_out(Path(out), run_dir, overwrite)
    cfg = typed(load_run_config(run_dir))  # the run's saved configuration, converted once
    records = list(read_jsonl(run_dir / "trajectory.jsonl"))
    if not records:
        raise ReplayError(f"{run_dir}/trajectory.jsonl is missing or empty: nothing to replay")
    target = step if step is not None else records[-1]["step"]
    if from_step is not None and from_step > target:
        raise ReplayError(f"--from-step {from_step} is after --step {target}")
    base, tensors, state = _nearest_snapshot(run_dir, target if from_step is None else from_step,
                                             initial=from_step == 0)
    if not same_directions(state.get("directions_version"), state["distribution"]):
        raise ReplayError(f"{base} drew its {state['distribution']} directions with scheme "
                          f"{state.get('directions_version')}; this distzo draws scheme {DIRECTIONS_VERSION}, so "
                          "replay it with the distzo version that trained it")
    todo = [r for r in records if state["step"] < r["step"] <= target]
    missing = sorted(set(range(state["step"] + 1, target + 1)) - {r["step"] for r in todo})
    if missing:
        raise ReplayError(f"trajectory.jsonl lacks steps {missing[:5]}{'...' if len(missing) > 5 else ''} "
                          f"between the snapshot at step {state['step']} and step {target} (the last step it "
                          f"logged is {records[-1]['step']})")

    if not estimator_type(cfg.estimator.name).replayable:
        raise ReplayError(f"{run_dir} was trained with estimator={cfg.estimator.name}, whose directions depend on "
                          "each step's activations (not only on the seed); it cannot be replayed from the trajectory "
                          "log, resume it from its snapshots instead")
    here = gaussian_generator_id(torch.device(device))
    foreign = [r for r in todo if state["distribution"] == "gaussian" and not r.get("skipped")
               and drawn_by(state, r) != here]
    if not foreign and state["distribution"] == "gaussian" and any("drawn_by" not in r for r in todo):
        # Logged before records named their generator: a snapshot between written by a session that
        # drew by another generator says that session drew the steps before it.
        elsewhere = snapshot_drawn_elsewhere(run_dir, state["step"], target, torch.device(device))
        if elsewhere is not None:
            foreign = [dict(todo[0], drawn_by=drawn_by(elsewhere[1]))]
    if foreign:
        # Records logged before they named their generator are taken as drawn by the snapshot's, and
        # snapshots from before it was recorded name only the device type, which no longer matches this
        # distzo's generator (CUDA Gaussian z changed with DIRECTIONS_VERSION 4, CPU's with 6).
        drawn, first = drawn_by(state, foreign[0]), foreign[0]["step"]
        if drawn.split(":")[0] != torch.device(device).type:
            raise ReplayError(f"the run drew step {first}'s Gaussian directions on {drawn.split(':')[0]}; replay with "
                              f"--device {drawn.split(':')[0]} (Gaussian generators differ between device types)")
        raise ReplayError(f"the run drew step {first}'s Gaussian directions by {drawn}, and this machine draws by "
                          f"{here} (the CPU's Gaussian scheme changed in distzo's directions version 6, CUDA's in "
                          "version 5, and CUDA's uses the GPU architecture's own ln, cos and sin); replay with the "
                          "distzo version that trained it (on a GPU of the recorded architecture for a CUDA run), "
                          "or train with estimator.distribution=rademacher, whose directions are the same "
                          "everywhere")
    # The same trainable set, built the same seeded way, on a resident engine of this process.
    optimizer_state = read_optimizer_state(base) if tensors is not None else None
    mesh = Mesh.single(device)
    sources = fetch_hub_pins(cfg, mesh, HubPins.from_record(state.get("sources")))  # the commits the run read
    stack = build_model_stack(cfg, mesh, state["seed"], weights=tensors, resident=True,
                              optimizer_state=optimizer_state, sources=sources)
    engine = stack.engine
    log.info("Replaying steps %d..%d of %s from %s", state["step"] + 1, target, run_dir,
             base.name if tensors is not None else "the initial weights")
    catch_up(engine, todo, 0, show=True)
    with engine.materialized() as weights:
        result = {p.name: p.tensor.detach().cpu().contiguous() for p in weights.params}
    stack.close()
    out = Path(out) if out else run_dir / "replay" / f"step-{target:08d}.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(result, out, metadata={"step": str(target)})
    log.info("Wrote the weights after step %d to %s", target, out)
    return out


def _check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise ReplayError(f"--device {device}: replay draws the directions on cpu or cuda, the device type the run "
                          "drew them on")
    if device == "cuda" and not torch.cuda.is_available():
        raise ReplayError(f"--device cuda: this machine has no CUDA device (torch {torch.__version__}); replay a CUDA "
                          "run on a GPU of the architecture it trained on")


def _check_out(out: Path, run_dir: Path, overwrite: bool) -> None:
    """Before anything loads: `out` is a file this process may write, and not one of the run's own
    weights (final/, checkpoints/), which a replay must never replace."""
    if out.is_dir():
        raise ReplayError(f"--out {out} is a directory; name a .safetensors file")
    resolved = out.resolve()
    for kept in ("final", "checkpoints"):
        if resolved.is_relative_to((run_dir / kept).resolve()):
            raise ReplayError(f"--out {out} is inside the run's {kept}/, whose weights a replay must not replace; "
                              "write it elsewhere (the default is RUN_DIR/replay/)")
    if out.exists() and not overwrite:
        raise ReplayError(f"--out {out} exists; name another file, or pass --force to replace it")
    writable_ancestor(out.parent, "--out")


def _nearest_snapshot(run_dir: Path, target: int, initial: bool = False):
    """(path, tensors, state) of the newest valid snapshot at or before `target`; with `initial`
    (--from-step 0), (run.json, None, its identity at step 0): the initial weights."""
    if initial:
        try:
            identity = json.loads((run_dir / RUN_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise ReplayError(f"--from-step 0 starts from the initial weights, which {run_dir}/{RUN_FILE} identifies, "
                              f"and it is unreadable ({exc})") from None
        return run_dir / RUN_FILE, None, dict(identity, step=0)
    candidates = [p for p in list_snapshots(run_dir) if int(p.name.split("-")[1]) <= target]
    for path in reversed(candidates):
        try:
            tensors, state = read_snapshot(path)
            return path, tensors, state
        except CorruptSnapshot as exc:
            log.warning("Skipping a corrupt snapshot: %s", exc)
    later = [int(p.name.split("-")[1]) for p in list_snapshots(run_dir) if int(p.name.split("-")[1]) > target]
    if candidates:
        why = "those at or before it are corrupt (the warnings above name them)"
    elif later:
        why = (f"its earliest snapshot is of step {later[0]} (checkpoint.every sets the cadence, checkpoint.keep how "
               "many stay)")
    else:
        why = "the run wrote none (checkpoint.every=0)"
    raise ReplayError(f"no valid snapshot at or before step {target} in {run_dir}/checkpoints: {why}; replay from "
                      "the initial weights with --from-step 0 (every logged step re-applied)")
