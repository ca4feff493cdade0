"""The bench's phase timers: a phase's wall time is split between `noise` and the phase in the
proportion of drawing to all work that the work clock saw during it."""

from __future__ import annotations

import time

import pytest
import torch

from distzo.telemetry.timing import Timers, WorkClock
from distzo.zo.directions import Directions, chunks_of


def test_a_phase_is_split_by_the_clocks_draw_share():
    clock = WorkClock()
    timers = Timers(True, clock=clock)
    clock.add(busy=5.0, draw=5.0)  # before the phase: not charged to it
    with timers("perturb"):
        time.sleep(0.05)
        clock.add(busy=2.0, draw=0.5)
    with timers("comm"):  # no work items: all of it is the phase's
        time.sleep(0.02)
    t = timers.take()
    assert set(t) == {"perturb", "noise", "comm"}
    wall = t["perturb"] + t["noise"]
    # 0.5 of 2.0 busy seconds drew z; the comm phase added nothing to noise
    assert wall >= 0.05 and t["noise"] == pytest.approx(0.25 * wall)
    assert t["comm"] >= 0.02
    assert timers.take() == {}  # take() resets


def test_a_nested_phase_is_charged_to_the_outer_one(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    timers = Timers(True, device=torch.device("cuda"))  # only to count the synchronisations
    with timers("update"):
        time.sleep(0.02)
        with timers("comm"):
            time.sleep(0.03)
    assert len(syncs) == 2  # the outer phase's boundaries only
    t = timers.take()
    assert set(t) == {"update", "noise"} and t["noise"] == 0.0
    assert t["update"] >= 0.05  # both sleeps
    with timers("comm"):  # the nesting is over: a phase of its own again
        time.sleep(0.01)
    assert set(timers.take()) == {"comm", "noise"} and len(syncs) == 4


def test_nothing_is_timed_while_paused(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    timers = Timers(True, device=torch.device("cuda"))
    with timers.paused():
        assert not timers.enabled
        with timers("perturb"):
            time.sleep(0.01)
    assert timers.take() == {} and syncs == []  # no totals, no CUDA synchronisation
    assert timers.enabled  # restored afterwards
    with timers("perturb"):
        pass
    assert set(timers.take()) == {"perturb", "noise"} and len(syncs) == 2


def test_directions_clock_sees_draws_inside_work_items():
    d = Directions(3, "gaussian", threads=2, clock=WorkClock())
    flat = torch.empty(3 * 2**20)
    refs = chunks_of(0, flat.shape)
    d.map(lambda r: (d.fill_chunk(flat[r.start:r.stop], 1, 0, r), flat[r.start:r.stop].mul_(2.0)), refs)
    busy, draw = d.clock.read()
    assert 0 < draw < busy  # the multiply is work but not drawing
    d.close()


def test_progress_estimates_from_the_pace_after_the_first_step(monkeypatch, caplog):
    """A 200-step run whose first step took 60 s (start-up, the zero-shot evaluation) and then 2 s a
    step: after 10 steps the ETA is 190 x 2 s, not 190 x 7.8 s."""
    import logging

    from distzo.telemetry import metrics

    clock = iter([0.0, 60.0, *[60.0 + 2.0 * k for k in range(1, 10)]])
    monkeypatch.setattr(metrics, "time", type("Clock", (), {"time": staticmethod(lambda: next(clock))}))
    progress = metrics.Progress("train step", 200, every_s=1e9)
    with caplog.at_level(logging.INFO, logger=metrics.log.name):
        for done in range(1, 11):
            progress.update(done, force=done == 10)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "train step 10/200" in line and f"ETA {metrics.format_duration(190 * 2.0)}" in line
    assert progress.eta(1, 60.0) == 60.0 * 199  # with only the first step and no measure of it: overall
    assert progress.eta(1, 60.0, pace_s=2.0) == 2.0 * 199  # the step's own time, as the loop measured it


def test_the_first_progress_line_of_a_run_uses_the_first_steps_own_time(monkeypatch, caplog):
    """The first line comes after step 1, 26 s after the start (the zero-shot evaluation ran in
    between) for a step of 1.5 s: its ETA is 199 x 1.5 s, not 199 x 26 s."""
    import logging

    from distzo.telemetry import metrics

    clock = iter([0.0, 26.0])
    monkeypatch.setattr(metrics, "time", type("Clock", (), {"time": staticmethod(lambda: next(clock))}))
    progress = metrics.Progress("train step", 200, every_s=15.0)
    with caplog.at_level(logging.INFO, logger=metrics.log.name):
        progress.update(1, "1.50s/step", pace_s=1.5)
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"ETA {metrics.format_duration(199 * 1.5)}" in line, line
