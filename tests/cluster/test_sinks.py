"""The metrics writer's sinks, without launching anything: what reaches wandb.init and run.log."""

from __future__ import annotations

import pytest

from distzo.telemetry.metrics import MetricsWriter
from distzo.telemetry.sinks import WandbSink, open_sinks
from tests.conftest import make_config


class FakeRun:
    id, dir = "fake", "."

    def __init__(self):
        self.logged, self.summary, self.finished = [], {}, False

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    import wandb

    calls = {}

    def init(**kwargs):
        calls.update(kwargs)
        calls["run"] = FakeRun()
        return calls["run"]

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return calls


def test_logger_none_opens_no_sink(tmp_path):
    assert open_sinks(make_config(), tmp_path, {}) == []


def test_wandb_is_offline_by_default_and_wandb_mode_wins(tmp_path, fake_wandb, monkeypatch):
    cfg = make_config("logger=wandb", "mesh=1x1")
    WandbSink(cfg, tmp_path / "run", {"world_size": 1})
    assert fake_wandb["mode"] == "offline" and fake_wandb["dir"] == str(tmp_path / "run")
    assert fake_wandb["name"] == "run" and fake_wandb["config"]["launch"] == {"world_size": 1}
    assert fake_wandb["config"]["optim"]["lr"] == cfg.optim.lr  # the resolved config
    monkeypatch.setenv("WANDB_MODE", "disabled")
    WandbSink(cfg, tmp_path / "run", {})
    assert fake_wandb["mode"] == "disabled"


def test_the_writer_forwards_every_record(tmp_path, fake_wandb):
    sink = WandbSink(make_config("logger=wandb"), tmp_path, {})
    writer = MetricsWriter(tmp_path / "metrics.jsonl", static={"mesh": "1x1"}, sinks=[sink])
    writer.write("eval", step=0, split="validation", accuracy=0.5, loss=0.7, examples=16)
    writer.write("train", step=1, loss=0.6, projected_grads=[1.0], lr=1e-3, tokens=90, skipped=False)
    writer.write("summary", steps=1, mesh_note="x", test_accuracy=0.75, replica_checksums=[1, 2])
    writer.close()
    run = fake_wandb["run"]
    assert run.logged == [(0, {"validation/accuracy": 0.5, "validation/loss": 0.7, "validation/examples": 16}),
                          (1, {"train/loss": 0.6, "train/lr": 1e-3, "train/tokens": 90})]
    assert run.summary["test_accuracy"] == 0.75 and run.summary["mesh"] == "1x1"
    assert "replica_checksums" not in run.summary  # lists stay in metrics.jsonl
    assert run.finished and (tmp_path / "metrics.jsonl").read_text().count("\n") == 3


def test_a_wandb_that_cannot_start_is_one_clear_error(tmp_path, monkeypatch):
    """The sink's own error, and a Trainer's: the same error (the model already built, its logs not
    yet open), and the run directory it created taken away."""
    import wandb

    import distzo
    from distzo.telemetry.sinks import SinkError

    def init(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", init)
    cfg = make_config("model=tiny", "logger=wandb", "logger.mode=online")
    with pytest.raises(SinkError, match=r"could not start an online run \(api_key not configured .*logger=none"):
        WandbSink(cfg, tmp_path, {})
    with pytest.raises(SinkError, match=r"could not start an online run \(api_key not configured .*logger=none"):
        distzo.Trainer(cfg, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
