"""Engines run a step's forward probes and its update (docs/architecture.md#engines).

`build_engine` picks the mode once, from the configuration and the mesh:

| mode | class | when |
|---|---|---|
| resident | `ResidentEngine` | the default |
| work-divided | `DividedEngine` | CPU, resident, several ranks on a machine, full-parameter MeZO (engine.divide_work) |
| offloaded | `OffloadEngine` | offload=cpu with one rank per node, or comm.sliced=false |
| offloaded, sliced | `SlicedOffloadEngine` | offload=cpu with several ranks per node and comm.sliced=true |
| stacked LoRA | `StackedLoRAEngine` | estimator=prge (P-RGE's batched forward) |
"""

from .base import Engine, EngineConfigError, Materialized
from .build import build_engine, work_division
from .divided import DividedEngine, division_applies
from .offload import OffloadEngine, SlicedOffloadEngine
from .stacked import StackedLoRAEngine
from .staged import ResidentEngine, StagedEngine

__all__ = ["DividedEngine", "Engine", "EngineConfigError", "Materialized", "OffloadEngine", "ResidentEngine",
           "SlicedOffloadEngine", "StackedLoRAEngine", "StagedEngine", "build_engine", "division_applies",
           "work_division"]
