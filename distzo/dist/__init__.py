"""Distributed machinery: the PxD mesh and its collectives, replica consistency."""

from .consistency import ReplicaDivergence, check_replicas, weights_checksum
from .mesh import Mesh, MeshError, MeshShape

__all__ = ["Mesh", "MeshError", "MeshShape", "ReplicaDivergence", "check_replicas", "weights_checksum"]
