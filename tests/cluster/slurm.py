"""A throw-away one-node SLURM cluster on localhost, for tests that submit `slurm/` scripts for real.

Everything lives in one directory: a private munged (own key and socket, so a system munged is never
touched), slurmctld and slurmd on free ports, a generated slurm.conf that needs no cgroups and no
accounting database. Commands find it through SLURM_CONF, which jobs inherit (srun inside sbatch).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.ports import free_port

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


class SlurmUnavailable(Exception):
    """This machine can never run the test cluster (not root, or SLURM missing and no apt-get to install it): the
    only case where the tests skip, with this message."""


class SlurmError(Exception):
    """Installing or starting the test cluster failed on a machine where it should work: the tests fail with this
    message (which names the log to read), since a skip would hide it."""


# Machine-wide (not TMPDIR, not pytest's basetemp), so that pytest-xdist workers and concurrent pytest sessions
# all take turns on the one install.
INSTALL_LOCK = Path("/tmp/distzo-slurm-install.lock")
APT_LOCK_WAIT_S = 300


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)),
                                       None)


def _missing() -> list[str]:
    return [d for d in DAEMONS if not _which(d)]


def ensure_installed(log: Path) -> None:
    """apt-get install slurm-wlm and munge when missing, once per machine: installers take turns on INSTALL_LOCK, and
    one that waited finds SLURM installed by the one before it (two at once lost the dpkg lock to each other).
    Root is needed even when SLURM is installed: the cluster's daemons run as root."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("SLURM tests need root: they install slurm-wlm and munge and start a one-node cluster "
                               "on localhost (run pytest as root)")
    if not _missing():
        return
    if not shutil.which("apt-get"):
        raise SlurmUnavailable("SLURM is not installed and apt-get is not available to install slurm-wlm and munge")
    with open(INSTALL_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not _missing():
            return
        _apt(["update"], log)
        _apt(["install", "-y", "--no-install-recommends", *PACKAGES], log)
    missing = _missing()
    if missing:
        raise SlurmError(f"installing {' '.join(PACKAGES)} did not provide {', '.join(missing)} (see {log})")


def _apt(args: list[str], log: Path) -> None:
    """`apt-get ARGS`, its output appended to `log`, waiting up to APT_LOCK_WAIT_S for any other apt or dpkg:
    apt-get install waits through DPkg::Lock::Timeout, apt-get update (which ignores that option for its lists
    lock) is run again while it reports a held lock."""
    cmd = ["apt-get", "-o", f"DPkg::Lock::Timeout={APT_LOCK_WAIT_S}", *args]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    deadline = time.monotonic() + APT_LOCK_WAIT_S
    with open(log, "a+") as out:
        while True:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            start = out.tell()
            try:
                r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=2 * APT_LOCK_WAIT_S)
            except subprocess.TimeoutExpired:
                raise SlurmError(f"`{' '.join(cmd)}` timed out after {2 * APT_LOCK_WAIT_S} s (see {log})") from None
            if r.returncode == 0:
                return
            out.seek(start)
            output = out.read()
            if "Could not get lock" not in output or time.monotonic() > deadline:
                errors = [line for line in output.splitlines() if line.startswith("E:")]
                raise SlurmError(f"`{' '.join(cmd)}` failed with exit status {r.returncode}"
                                 f"{': ' + errors[-1] if errors else ''} (see {log})")
            time.sleep(5)


CONF = """\
ClusterName=distzotest
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again only once its credentials expire (default 120 s)
AuthInfo=socket={munge_socket},cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups, no accounting database: plugins that work in any container
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# a pending job (a requeued one once its credentials expire) starts within a second, not at the next
# backfill pass (default every 30 s) or main scheduling pass (60 s)
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# CPUs below may exceed a small machine's cores
SlurmdParameters=config_overrides
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    """Start with `start()`, stop with `stop()`; `env` is what sbatch/srun/scontrol need."""

    def __init__(self, root: Path, cpus: int = 2):
        self.root, self.cpus = Path(root), cpus
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._pidfiles = [self.root / "slurmd.pid", self.root / "slurmctld.pid", self.root / "munge" / "munged.pid"]

    def start(self, timeout_s: float = 60.0) -> LocalSlurm:
        ensure_installed(self.root / "apt.log")
        for d in ("state", "spool", "munge"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        self.conf.write_text(CONF.format(root=self.root, cpus=self.cpus, ctld_port=free_port(),
                                         slurmd_port=free_port(), munge_socket=self.munge_socket))
        m = self.root / "munge"
        self._run([_which("munged"), "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                   f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'seed'}"])
        self._run([_which("slurmctld"), "-f", str(self.conf)])
        self._run([_which("slurmd"), "-f", str(self.conf), "-N", "localhost"])
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            r = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%t"], env=self.env, capture_output=True, text=True)
            if r.returncode == 0 and r.stdout.strip() in ("idle", "mix", "alloc"):
                return self
            time.sleep(0.5)
        self.stop()
        raise SlurmError(f"the test cluster did not come up within {timeout_s:.0f} s (node state "
                               f"{r.stdout.strip() or r.stderr.strip()!r}; logs in {self.root})")

    def _run(self, cmd: list[str]) -> None:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            self.stop()
            raise SlurmError(f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()[-500:]}")

    def stop(self) -> None:
        """Stop the daemons this cluster started (by their pid files): signal all, then wait for each."""
        pids = []
        for pidfile in self._pidfiles:
            try:
                pid = int(pidfile.read_text().strip())
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except (OSError, ValueError):
                continue
        deadline = time.time() + 10
        for pid in pids:
            while time.time() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
