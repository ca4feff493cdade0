"""Mesh shapes and the launched world, without importing torch (the CLI checks them before any heavy import)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import DistzoError


class MeshError(DistzoError):
    """A mesh that cannot be built; the message names the fix."""


@dataclass(frozen=True)
class MeshShape:
    pert: int
    data: int

    @property
    def size(self) -> int:
        return self.pert * self.data

    def __str__(self) -> str:
        return f"{self.pert}x{self.data}"

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
        if not m:
            raise MeshError(f"mesh={text!r} is not PxD; write it as mesh=2x2 (P perturbation ranks x D data ranks)")
        pert, data = int(m.group(1)), int(m.group(2))
        if pert < 1 or data < 1:
            raise MeshError(f"mesh={text}: both degrees must be at least 1 (e.g. mesh=1x4, mesh=2x2)")
        return cls(pert, data)

    def check_world(self, world: int) -> None:
        if self.size == world:
            return
        fits = ", ".join(f"{p}x{world // p}" for p in range(1, world + 1) if world % p == 0)
        if world == 1:
            raise MeshError(f"mesh={self} needs {self.size} processes but this is a single process; run "
                            f"python -m distzo train mesh={self} (it starts its {self.size} workers), or launch "
                            f"{self.size} processes with torchrun --nproc-per-node {self.size} or "
                            f"srun --ntasks {self.size}")
        raise MeshError(f"mesh={self} needs {self.size} processes but the job has {world}; use a mesh whose "
                        f"product is {world} ({fits}) or launch {self.size} processes")
