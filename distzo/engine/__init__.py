"""Engines run a step's forward probes and its update (docs/architecture.md#engines).

Every mode is the one step loop (`StageLoop`) over a weight store; `build_engine` picks the mode
once, from the configuration and the mesh, among the registered engine modes (the table in
distzo/engine/build.py). Each store's module registers its mode and offers a function that builds
its loop directly (`resident_engine`, `divided_engine`, `offload_engine`, `sliced_offload_engine`,
`stacked_lora_engine`, `streamed_base_engine`).
"""

from .base import Engine, EngineConfigError, Materialized
from .build import EngineMode, EngineSetup, build_engine, resident_engine
from .divided import divided_engine, division_applies, work_division
from .loop import StageLoop
from .offload import offload_engine, sliced_offload_engine
from .stacked import stacked_lora_engine
from .streamed_base import streamed_base_engine

__all__ = ["divided_engine", "Engine", "EngineConfigError", "EngineMode", "EngineSetup", "Materialized",
           "offload_engine", "resident_engine", "sliced_offload_engine", "stacked_lora_engine", "streamed_base_engine",
           "StageLoop", "build_engine", "division_applies", "work_division"]
