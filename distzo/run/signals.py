"""Graceful stop: SIGTERM, SIGUSR1 or SIGINT (and under submitit its SIGUSR2) end a run after the
step in flight, with a snapshot.

SIGTERM is what `kill`, torchrun's agent and SLURM (at preemption and at the time limit) send;
SIGUSR1 is the early warning `slurm/train.sbatch` asks SLURM for. A handler only records the signal.
At the end of every step the ranks agree (one tiny all-reduce) whether any of them was signalled,
so every rank stops after the same step, writes the snapshot of that step together, and exits with
`EXIT_STOPPED`. A second SIGINT (Ctrl-C twice) aborts at once, except while a snapshot is being
written: signals arriving then are held until it is complete, so a snapshot is never left half
written by them (and `resume=auto` would skip one anyway: snapshots land by atomic rename).
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

log = logging.getLogger("distzo")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# submitit's timeout and preemption signal: handled too when a launcher installed a handler for it
# (submitit's requeue), which is then handed the signal once the snapshot is written (`hand_over`).
LAUNCHER_SIGNALS = (signal.SIGUSR2,)
# EX_TEMPFAIL (sysexits.h): "a temporary failure; the user is invited to retry". The run stopped on a
# signal with a snapshot of the step it reached; rerun with resume=auto to continue.
EXIT_STOPPED = 75


class Stopped(Exception):
    """The run stopped early on a signal, after writing a snapshot of `step`."""

    def __init__(self, step: int, signame: str, snapshot: str | None):
        super().__init__(f"stopped on {signame} after step {step}")
        self.step, self.signame, self.snapshot = step, signame, snapshot


class StopRequests:
    """Records stop signals while active (a context manager; handlers are installed in the main
    thread only, and the previous ones restored on exit)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._holding = False
        self._held: list[int] = []
        self._previous: dict[int, object] = {}
        # Set once the last step is done: a stop then lets the run finish (its final evaluations and
        # saved model take less than a resume would redo), and says so.
        self.finishing = False

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            for sig in LAUNCHER_SIGNALS:
                if callable(signal.getsignal(sig)):  # a launcher's own handler (submitit's requeue)
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "-"

    def _handle(self, signum: int, frame) -> None:
        if self._holding:
            self._held.append(signum)
            return
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now (at most the step in flight is lost)
        if self.signum is None:
            self.signum = signum
            again = " (Ctrl-C again to abort now)" if signum == signal.SIGINT else ""
            if self.finishing:
                log.warning("%s received after the last step: finishing the final evaluations and the saved model, "
                            "then exit%s", signal.Signals(signum).name, again)
            else:
                log.warning("%s received: finishing the step in flight, then a snapshot and exit%s",
                            signal.Signals(signum).name, again)

    def agreed(self, mesh) -> bool:
        """Whether any rank has been signalled: every rank calls this at the same point of every step
        (a collective, so all stop after the same step)."""
        mine = 1.0 if self.requested else 0.0
        if not mesh.distributed:
            return bool(mine)
        (total,) = mesh.all_sum([mine])
        if total and self.signum is None:
            self.signum = signal.SIGTERM  # a peer was signalled
        return total > 0

    def hand_over(self) -> None:
        """After the stop's snapshot: a launcher's signal (submitit's SIGUSR2) goes on to the handler
        the launcher installed, which requeues the job (rank 0) so that it continues with resume=auto."""
        previous = self._previous.get(self.signum) if self.signum in LAUNCHER_SIGNALS else None
        if callable(previous):
            signal.signal(self.signum, previous)
            previous(self.signum, None)

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Signals arriving inside are recorded and acted on after it (a snapshot being written)."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            held, self._held = self._held, []
            for signum in held:
                if signum == signal.SIGINT and self.signum is not None:
                    continue  # the stop is under way already: the snapshot is complete, exit follows
                self._handle(signum, None)
