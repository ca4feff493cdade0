"""Running a sweep's jobs: locally one after another (their timings do not compete), or all submitted
to SLURM at once and waited for; each finished job becomes a row of the report."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ...config.schema import SweepConfig
from .expansion import SweepError
from .report import Row, summarize_metrics, write_outputs


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


def local_command(job: Job) -> list[str]:
    """One process runs plainly; more run under torchrun --standalone (a private rendezvous)."""
    train = ["-m", "distzo", "train", *job.overrides, f"hydra.run.dir={job.run_dir}"]
    if job.nproc == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={job.nproc}", *train]


def default_script() -> Path | None:
    """slurm/train.sbatch of the source tree distzo runs from (None for an installed wheel)."""
    candidate = Path(__file__).resolve().parents[3] / "slurm" / "train.sbatch"
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

    def __init__(self, jobs: list[Job], root: Path, settings: SweepConfig, say: Callable[[str], None] | None = None):
        self.jobs, self.root, self.sc = jobs, root, settings
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
