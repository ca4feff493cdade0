"""Shared constants and helpers of the cluster tests."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
# A few steps of the tiny model; evaluations before and after on 16 examples each.
FAST = ("model=tiny", "task=synthetic-cue", "steps=3", "eval_every=0", "task.val_size=16", "task.test_size=16",
        "checkpoint.every=0", "log_every=1000")


# A job's states that do not change again (scontrol's JobState): any other (PENDING, RUNNING,
# CONFIGURING, COMPLETING, REQUEUED, SUSPENDED, SIGNALING, STAGE_OUT, RESIZING...) is waited out.
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT")


def wait_for_jobs(cluster, job_ids: list[str], timeout_s: float = 300) -> dict[str, tuple[str, int]]:
    """Poll `scontrol show job` until every job has ended: {job id: (state, exit code)}. (sbatch --wait
    polls at growing intervals of up to 32 s, too coarse for a test.)"""
    done: dict[str, tuple[str, int]] = {}
    deadline = time.time() + timeout_s
    while len(done) < len(job_ids) and time.time() < deadline:
        for jid in job_ids:
            if jid in done:
                continue
            out = subprocess.run(["scontrol", "show", "job", "-o", jid], env=cluster.env, capture_output=True,
                                 text=True).stdout
            fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
            if fields.get("JobState") in FINAL_STATES:
                done[jid] = (fields["JobState"], int(fields.get("ExitCode", "0:0").split(":")[0]))
        time.sleep(0.5)
    assert len(done) == len(job_ids), f"SLURM jobs still running after {timeout_s} s: {set(job_ids) - set(done)}"
    return done
