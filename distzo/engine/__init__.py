"""Engines run a step's forward probes and its update (docs/architecture.md#engines).

Every mode is the one step loop (`StageLoop`) over a weight store; `build_engine` picks the mode
once, from the configuration and the mesh (the table in distzo/engine/build.py):
`resident_engine`, `divided_engine`, `offload_engine`, `sliced_offload_engine` and `stacked_lora_engine`
build each mode's loop.
"""

from .base import Engine, EngineConfigError, Materialized
from .build import (
    build_engine,
    divided_engine,
    offload_engine,
    resident_engine,
    sliced_offload_engine,
    stacked_lora_engine,
    work_division,
)
from .divided import division_applies
from .loop import StageLoop

__all__ = ["divided_engine", "Engine", "EngineConfigError", "Materialized", "offload_engine", "resident_engine",
           "sliced_offload_engine", "stacked_lora_engine", "StageLoop", "build_engine", "division_applies",
           "work_division"]
