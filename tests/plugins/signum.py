"""The example optimizer of examples/plugins/signum.py (Signum, one state slot, one setting, no case
in the fused CPU kernel), registered in this process when imported: tests/distributed/
test_estimator_layouts.py imports it here and in its spawned workers, as DISTZO_PLUGINS does for a
run's processes."""

from __future__ import annotations

from pathlib import Path

from distzo.registry import load_plugin

PATH = str(Path(__file__).resolve().parents[2] / "examples" / "plugins" / "signum.py")
Signum = load_plugin(PATH).Signum
BETA = Signum.Settings.beta
