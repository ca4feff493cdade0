"""The bench's phase timers: a phase's wall time is split between `noise` and the phase in the
proportion of drawing to all work that the work clock saw during it."""

from __future__ import annotations

import time

import pytest
import torch

from distzo.timing import Timers, WorkClock
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
    wall = t["perturb"] + t["noise"]
    assert wall >= 0.05 and t["noise"] == pytest.approx(0.25 * wall)
    assert t["comm"] >= 0.02 and t["noise"] == pytest.approx(0.25 * wall)


def test_directions_clock_sees_draws_inside_work_items():
    d = Directions(3, "gaussian", threads=2, clock=WorkClock())
    flat = torch.empty(3 * 2**20)
    refs = chunks_of(0, flat.shape)
    d.map(lambda r: (d.fill_chunk(flat[r.start:r.stop], 1, 0, r), flat[r.start:r.stop].mul_(2.0)), refs)
    busy, draw = d.clock.read()
    assert 0 < draw < busy  # the multiply is work but not drawing
    d.close()
