"""A Hydra callback (hydra.callbacks) that appends each event it sees to a file, one line each, for
tests/e2e/test_cli.py's comparison of a plain run with hydra.main's."""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback


class RecordEvents(Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def _record(self, event: str, detail: str = "") -> None:
        with open(self.path, "a") as fh:
            fh.write(f"{event} {detail}".rstrip() + "\n")

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        self._record("on_run_start", f"steps={config.steps}")

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        self._record("on_job_start", f"mode={config.hydra.mode}")

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        status = job_return.status.name
        returned = f" return={job_return.return_value}" if status == "COMPLETED" else ""
        self._record("on_job_end", f"status={status}{returned}")

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        self._record("on_run_end")
