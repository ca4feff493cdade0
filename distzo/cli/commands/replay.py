"""`python -m distzo replay RUN_DIR [--step N] [--out FILE] [--device cpu|cuda]`: a run's weights at
any logged step, from a snapshot and the trajectory log."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ...registry import register
from . import Command


@register("command", "replay")
class Replay(Command):
    """rebuild a run's weights at any logged step from a snapshot and the trajectory log"""

    @classmethod
    def run(cls, args: list[str]) -> None:
        parser = argparse.ArgumentParser(prog="python -m distzo replay", description=(
            "Rebuild the trainable weights after any logged step from the nearest snapshot and the "
            "trajectory log, without data or forward passes (MeZO's seed trick)."))
        parser.add_argument("run_dir", help="a training run directory (with checkpoints/ and trajectory.jsonl)")
        parser.add_argument("--step", type=int, default=None, help="replay up to this step (default: the last logged)")
        parser.add_argument("--from-step", type=int, default=None,
                            help="start from the newest snapshot at or before this step (default: nearest to --step)")
        parser.add_argument("--out", default=None,
                            help="output .safetensors (default: RUN_DIR/replay/step-N.safetensors)")
        parser.add_argument("--force", action="store_true", help="replace --out if it exists")
        parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                            help="device type the run drew its directions on")
        ns = parser.parse_args(args)
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
        from ...run.replay import replay

        print(replay(Path(ns.run_dir), ns.step, Path(ns.out) if ns.out else None, ns.device, ns.from_step,
                     overwrite=ns.force))
