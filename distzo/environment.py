"""Process-wide defaults distzo sets before torch loads (`import distzo` applies them; a value you set
yourself always wins). The Hugging Face hub's settings (HF_HUB_OFFLINE, HF_ENDPOINT, HF_TOKEN, HF_HOME)
are the user's: distzo sets none of them and honours what is set (distzo.hub)."""

from __future__ import annotations

import os


def apply_defaults() -> None:
    """Before torch (with its OpenMP runtime) loads: after each parallel region libgomp's threads
    spin for ~300,000 iterations (milliseconds) by default, and after every block's forward that spin
    takes a core from the threads that build the next block's working copies (measured on the
    embedded default: the Gaussian perturb phase 0.67-0.71 s -> 0.54-0.57 s). 10,000 iterations
    still bridge the microsecond gaps between the ops of a forward. A user's OMP_WAIT_POLICY wins
    too (libgomp lets an explicit GOMP_SPINCOUNT override it)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
