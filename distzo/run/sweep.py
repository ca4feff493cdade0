"""`python -m distzo sweep`: run every combination of comma-separated override values as its own
training job, then tabulate and plot what each run's metrics.jsonl says.

    python -m distzo sweep mesh=1x4,2x2,4x1 model=tiny steps=100

Each combination n (the cartesian product, in Hydra's order) runs in `<hydra.sweep.dir>/<n>` as a
torchrun job of P*D processes: locally one after another (so their timings do not compete), or with
`sweep.launcher=slurm` all submitted at once through `slurm/train.sbatch` and waited for. A failing
job is a row of the table, not the end of the sweep; the command exits 1 if any failed.

Table columns, all computed from the run's metrics.jsonl (rank 0's view):
  tokens_per_s   tokens of all logged steps / their summed step time
  step_time_s    median step time
  peak_mem_bytes the largest peak_mem_bytes logged (CUDA allocator peak, or peak RSS on CPU)
  val_accuracy / val_loss   the last validation evaluation
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import DistzoError
from ..telemetry.jsonl import read_jsonl

COLUMNS = ("n", "label", "mesh", "status", "exit_code", "tokens_per_s", "step_time_s", "peak_mem_bytes",
           "val_accuracy", "val_loss", "steps", "wall_s", "run_dir")


class SweepError(DistzoError):
    """A sweep that cannot start; the message names the fix."""


@dataclass
class Job:
    """One combination of the sweep and where it runs."""

    n: int
    overrides: list[str]  # the combination's full override list, as passed to `train`
    swept: list[str]  # just the swept key=value pairs (the row's label)
    mesh: str
    run_dir: Path

    @property
    def label(self) -> str:
        return " ".join(self.swept)

    @property
    def nproc(self) -> int:
        p, d = (int(x) for x in self.mesh.lower().split("x"))
        return p * d


@dataclass
class Row:
    n: int
    label: str
    mesh: str
    status: str = "ok"
    exit_code: int | None = 0
    tokens_per_s: float = math.nan
    step_time_s: float = math.nan
    peak_mem_bytes: float = math.nan
    val_accuracy: float = math.nan
    val_loss: float = math.nan
    steps: int = 0
    wall_s: float = math.nan
    run_dir: str = ""
    error: str = field(default="", repr=False)


# --- expanding the command line --------------------------------------------------------------------

def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(overrides for the runs, overrides of the sweep itself: sweep.* and hydra.sweep.*)."""
    runs, own = [], []
    for o in overrides:
        key = _key(o)
        if key == "hydra.run.dir":
            raise SweepError("a sweep sets each run's directory to <hydra.sweep.dir>/<n>; set hydra.sweep.dir=... "
                             "instead of hydra.run.dir")
        (own if key.startswith(("sweep.", "hydra.sweep.")) else runs).append(o)
    return runs, own


def expand(overrides: Sequence[str]) -> list[tuple[list[str], list[str]]]:
    """Every combination of the sweep values (cartesian product, first key outermost like Hydra's
    basic sweeper): [(full override list, swept key=value pairs)]."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    choices: list[list[str]] = []
    swept_at: list[int] = []
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            values = [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            if not values:
                raise SweepError(f"{o.input_line}: the sweep has no values; list them as key=a,b,c")
            choices.append(values)
            swept_at.append(i)
        else:
            choices.append([o.input_line])
    if not swept_at:
        raise SweepError("nothing to sweep: give at least one key several comma-separated values, e.g. "
                         "python -m distzo sweep mesh=1x2,2x1 model=tiny")
    return [(list(combo), [combo[i] for i in swept_at]) for combo in itertools.product(*choices)]


# --- reading a run ---------------------------------------------------------------------------------

def summarize_metrics(path: Path) -> dict[str, Any]:
    """The table's numbers from one run's metrics.jsonl (see the module docstring)."""
    records = read_jsonl(path)
    train = [r for r in records if r.get("type") == "train" and not r.get("skipped")]
    evals = [r for r in records if r.get("type") == "eval" and r.get("split") == "validation"]
    summary = [r for r in records if r.get("type") == "summary"]
    timed = [r for r in train if r.get("step_time_s")]
    total_time = sum(r["step_time_s"] for r in timed)
    peaks = [r["peak_mem_bytes"] for r in train + summary if r.get("peak_mem_bytes") is not None]
    return {
        "tokens_per_s": sum(r["tokens"] for r in timed) / total_time if total_time else math.nan,
        "step_time_s": statistics.median(r["step_time_s"] for r in timed) if timed else math.nan,
        "peak_mem_bytes": max(peaks) if peaks else math.nan,
        "val_accuracy": evals[-1]["accuracy"] if evals and evals[-1]["accuracy"] is not None else math.nan,
        "val_loss": evals[-1]["loss"] if evals else math.nan,
        "steps": max((r["step"] for r in train), default=0),
        "finished": bool(summary),
    }


# --- launching -------------------------------------------------------------------------------------

def local_command(job: Job) -> list[str]:
    """One process runs plainly; more run under torchrun --standalone (a private rendezvous)."""
    train = ["-m", "distzo", "train", *job.overrides, f"hydra.run.dir={job.run_dir}"]
    if job.nproc == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={job.nproc}", *train]


def default_script() -> Path | None:
    """slurm/train.sbatch of the source tree distzo runs from (None for an installed wheel)."""
    candidate = Path(__file__).resolve().parents[2] / "slurm" / "train.sbatch"
    return candidate if candidate.is_file() else None


def slurm_command(job: Job, sc, script: Path) -> list[str]:
    return [sc.sbatch, "--parsable", f"--nodes={sc.nodes}", f"--job-name=distzo-sweep-{job.n}",
            f"--output={job.run_dir}/slurm-%j.out",
            f"--export=ALL,NPROC_PER_NODE={job.nproc // sc.nodes},PYTHON={sys.executable}",
            *sc.sbatch_args, str(script), *job.overrides, f"hydra.run.dir={job.run_dir}"]


def _last_progress(log: Path) -> str:
    """The newest progress line of a job's console log, for the sweep's own progress lines."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - 4096))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith("[") and ("step" in line or "eval" in line or "Model" in line):
            return re.sub(r"^\[[^]]*\]\s*", "", line)[:120]
    return ""


def _error_line(log: Path) -> str:
    """The first distzo error or Python exception line of a failed job's log."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for pattern in (r"distzo: error: .*", r"^\w*(Error|Exception): .*"):
        for line in lines:
            m = re.search(pattern, line)
            if m:
                return m.group(0)[:200]
    return ""


class Sweep:
    """Runs the jobs, then writes sweep.json / sweep.csv / sweep.md / sweep.png into `root`."""

    def __init__(self, jobs: list[Job], root: Path, cfg, say: Callable[[str], None] | None = None):
        self.jobs, self.root, self.sc = jobs, root, cfg.sweep
        self.tools = {"scontrol": "scontrol", "scancel": "scancel"}
        self.say = say or (lambda text: print(f"[sweep] {text}", flush=True))

    def run(self) -> list[Row]:
        if (self.root / "sweep.json").exists():
            raise SweepError(f"{self.root} already holds a sweep (sweep.json); choose another hydra.sweep.dir")
        script = self._check_slurm() if self.sc.launcher == "slurm" else None
        self.root.mkdir(parents=True, exist_ok=True)
        for job in self.jobs:
            job.run_dir.mkdir(parents=True, exist_ok=True)
        self.say(f"{len(self.jobs)} runs ({self.sc.launcher}) in {self.root}")
        rows = self._run_slurm(script) if self.sc.launcher == "slurm" else [self._run_local(j) for j in self.jobs]
        write_outputs(rows, self.root)
        return rows

    # local: one after another ------------------------------------------------------------------

    def _run_local(self, job: Job) -> Row:
        cmd = local_command(job)
        log = job.run_dir / "console.log"
        self.say(f"{job.n + 1}/{len(self.jobs)} {job.label}: {job.nproc} process(es), log {log}")
        start = time.time()
        with open(log, "wb") as out:
            # A session of its own: Ctrl-C reaches the sweep, which then stops the whole job.
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = self._wait(proc.poll, job, log, start)
            except BaseException:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
                raise
        return self._row(job, code, time.time() - start, log)

    def _wait(self, poll: Callable[[], int | None], job: Job, log: Path, start: float) -> int:
        next_report = start + self.sc.progress_every_s
        while (code := poll()) is None:
            time.sleep(0.2)
            if time.time() >= next_report:
                next_report += self.sc.progress_every_s
                last = _last_progress(log)
                self.say(f"{job.n + 1}/{len(self.jobs)} {job.label}: running {time.time() - start:.0f}s"
                         + (f" | {last}" if last else ""))
        return code

    # SLURM: all submitted, then waited for --------------------------------------------------------

    def _check_slurm(self) -> Path:
        sbatch = shutil.which(self.sc.sbatch)
        if sbatch is None:
            raise SweepError(f"sweep.launcher=slurm needs sbatch, but '{self.sc.sbatch}' was not found; run on a SLURM "
                             "login node, set sweep.sbatch=/path/to/sbatch, or use sweep.launcher=local")
        # scontrol (to wait) and scancel (on Ctrl-C): beside sbatch, else on PATH
        self.tools = {name: str(Path(sbatch).with_name(name)) if Path(sbatch).with_name(name).is_file() else name
                      for name in ("scontrol", "scancel")}
        for job in self.jobs:  # before anything is submitted
            if job.nproc % self.sc.nodes:
                raise SweepError(f"mesh={job.mesh} has {job.nproc} rank(s), which do not split evenly over "
                                 f"sweep.nodes={self.sc.nodes}; choose layouts whose P*D is a multiple of the nodes")
        script = Path(self.sc.script).expanduser() if self.sc.script else default_script()
        if script is None or not script.is_file():
            raise SweepError(f"the SLURM job script {script or 'slurm/train.sbatch'} was not found; pass "
                             "sweep.script=/path/to/train.sbatch")
        return script

    def _run_slurm(self, script: Path) -> list[Row]:
        submitted: dict[int, str] = {}
        start: dict[int, float] = {}
        rows: dict[int, Row] = {}
        try:
            for job in self.jobs:
                cmd = slurm_command(job, self.sc, script)
                r = subprocess.run(cmd, capture_output=True, text=True)
                start[job.n] = time.time()
                if r.returncode != 0:
                    rows[job.n] = self._row(job, r.returncode, 0.0, None, error=f"sbatch: {r.stderr.strip()[:200]}")
                    self.say(f"{job.n + 1}/{len(self.jobs)} {job.label}: submission failed: {rows[job.n].error}")
                    continue
                submitted[job.n] = r.stdout.strip().split(";")[0]
                self.say(f"{job.n + 1}/{len(self.jobs)} {job.label}: SLURM job {submitted[job.n]} "
                         f"({self.sc.nodes} node(s) x {job.nproc // self.sc.nodes} rank(s))")
            next_report = time.time() + self.sc.progress_every_s
            while len(rows) < len(self.jobs):
                time.sleep(1.0)
                report = time.time() >= next_report
                if report:
                    next_report += self.sc.progress_every_s
                for job in self.jobs:
                    if job.n in rows:
                        continue
                    state, code = slurm_job_state(submitted[job.n], self.tools["scontrol"])
                    log = next(job.run_dir.glob(f"slurm-{submitted[job.n]}.out"), None)
                    if state in FINISHED_STATES:
                        code = code if state == "COMPLETED" or code else 1
                        rows[job.n] = self._row(job, code, time.time() - start[job.n], log,
                                                error="" if state == "COMPLETED" else f"SLURM state {state}")
                    elif report:
                        last = _last_progress(log) if log else ""
                        self.say(f"{job.n + 1}/{len(self.jobs)} {job.label}: job {submitted[job.n]} {state.lower()}"
                                 + (f" | {last}" if last else ""))
        except BaseException:
            pending = [jid for n, jid in submitted.items() if n not in rows]
            if pending:
                subprocess.run([self.tools["scancel"], *pending], capture_output=True)
            raise
        return [rows[j.n] for j in self.jobs]

    # -------------------------------------------------------------------------------------------------

    def _row(self, job: Job, code: int, wall: float, log: Path | None, error: str = "") -> Row:
        row = Row(job.n, job.label, job.mesh, exit_code=code, wall_s=round(wall, 1), run_dir=str(job.run_dir))
        metrics = job.run_dir / "metrics.jsonl"
        found = summarize_metrics(metrics) if metrics.exists() else {}
        for key in ("tokens_per_s", "step_time_s", "peak_mem_bytes", "val_accuracy", "val_loss", "steps"):
            if key in found:
                setattr(row, key, found[key])
        if code != 0 or not found.get("finished"):
            row.status = f"failed (exit {code})" if code else "failed (no summary)"
            row.error = error or (_error_line(log) if log else "")
        done = f"{job.n + 1}/{len(self.jobs)} {job.label}: {row.status} in {wall:.0f}s"
        if row.status == "ok":
            done += (f": {row.tokens_per_s:.1f} tokens/s, {row.step_time_s:.3f} s/step, "
                     f"peak {row.peak_mem_bytes / 2**20:.0f} MiB, validation accuracy {row.val_accuracy:.4f}")
        elif row.error:
            done += f": {row.error}"
        self.say(done)
        return row


FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE", "GONE"}


def slurm_job_state(job_id: str, scontrol: str = "scontrol") -> tuple[str, int]:
    """(state, exit code) from `scontrol show job` (no accounting database needed). A job that
    scontrol no longer knows (older than MinJobAge) reads as GONE: its metrics decide."""
    r = subprocess.run([scontrol, "show", "job", "-o", job_id], capture_output=True, text=True)
    if r.returncode != 0:
        return "GONE", 0
    state = re.search(r"JobState=(\S+)", r.stdout)
    code = re.search(r"ExitCode=(\d+):(\d+)", r.stdout)
    exit_code = int(code.group(1)) if code else 0
    if code and not exit_code and int(code.group(2)):
        exit_code = 128 + int(code.group(2))  # killed by a signal
    return (state.group(1) if state else "UNKNOWN"), exit_code


# --- outputs -------------------------------------------------------------------------------------

def _fmt(value: Any, spec: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return format(value, spec)


def markdown_table(rows: Sequence[Row]) -> str:
    head = ("| n | run | mesh | tokens/s | median step (s) | peak memory (MiB) | val accuracy | val loss | steps "
            "| status |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        mem = r.peak_mem_bytes / 2**20 if not math.isnan(r.peak_mem_bytes) else math.nan
        lines.append(f"| {r.n} | {r.label} | {r.mesh} | {_fmt(r.tokens_per_s, '.1f')} | {_fmt(r.step_time_s, '.4f')} | "
                     f"{_fmt(mem, '.0f')} | {_fmt(r.val_accuracy, '.4f')} | {_fmt(r.val_loss, '.4f')} | {r.steps} | "
                     f"{r.status}{': ' + r.error.replace('|', '/') if r.error else ''} |")
    return "\n".join(lines) + "\n"


def _json_safe(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def write_outputs(rows: Sequence[Row], root: Path) -> None:
    """sweep.json (every field), sweep.csv (the table's columns, full precision), sweep.md, sweep.png."""
    records = [{k: _json_safe(v) for k, v in asdict(r).items()} for r in rows]
    (root / "sweep.json").write_text(json.dumps({"columns": list(COLUMNS), "runs": records}, indent=1) + "\n")
    with open(root / "sweep.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    (root / "sweep.md").write_text(markdown_table(rows))
    plot(rows, root / "sweep.png")


def plot(rows: Sequence[Row], path: Path) -> None:
    """Four bar charts, one bar per run (failed runs: an empty slot marked 'failed')."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt

    panels = [("tokens_per_s", "throughput (tokens/s)", 1.0), ("step_time_s", "median step time (s)", 1.0),
              ("peak_mem_bytes", "peak memory (MiB)", 2.0**-20), ("val_accuracy", "final validation accuracy", 1.0)]
    labels = [r.label for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(max(8.0, 1.3 * len(rows) + 4), 7), constrained_layout=True)
    for ax, (key, title, scale) in zip(axes.flat, panels):
        values = [getattr(r, key) * scale for r in rows]
        xs = range(len(rows))
        ax.bar(xs, [0.0 if math.isnan(v) else v for v in values],
               color=["tab:blue" if r.status == "ok" else "tab:red" for r in rows])
        for x, v, r in zip(xs, values, rows):
            if r.status != "ok":
                ax.text(x, 0, "failed", ha="center", va="bottom", color="tab:red", rotation=90)
            elif not math.isnan(v):
                ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title)
        ax.set_xticks(list(xs), labels, rotation=30 if len(rows) > 4 else 0, ha="right" if len(rows) > 4 else "center")
    fig.suptitle(f"distzo sweep: {len(rows)} runs")
    fig.savefig(path, dpi=100)
    plt.close(fig)
