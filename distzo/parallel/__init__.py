"""Distributed machinery: the PxD mesh and its collectives (mesh.py), mesh shapes checked without torch
(shape.py), replica consistency (consistency.py)."""
