"""Engines run a step's forward evaluations and its update; they differ in where weights live."""

from .resident import ResidentEngine

__all__ = ["ResidentEngine"]
