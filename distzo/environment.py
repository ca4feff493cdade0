"""Process-wide defaults distzo sets before torch loads (`import distzo` applies them; a value you set
yourself always wins). The Hugging Face hub's settings (HF_HUB_OFFLINE, HF_ENDPOINT, HF_TOKEN, HF_HOME)
are the user's: distzo sets none of them and honours what is set (distzo.hub)."""

from __future__ import annotations

import logging
import os
import re


def apply_defaults() -> None:
    """Before torch (with its OpenMP runtime) loads: after each parallel region libgomp's threads
    spin for ~300,000 iterations (milliseconds) by default, and after every block's forward that spin
    takes a core from the threads that build the next block's working copies (measured on the
    embedded default: the Gaussian perturb phase 0.67-0.71 s -> 0.54-0.57 s). 10,000 iterations
    still bridge the microsecond gaps between the ops of a forward. A user's OMP_WAIT_POLICY wins
    too (libgomp lets an explicit GOMP_SPINCOUNT override it)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    quiet_known_noise()


# Import-time warnings that say nothing about the run. transformers imports torchao whenever it is
# installed (the `quant` extra, model.quantize); torchao then tries its compiled extensions (CUDA
# kernels of formats distzo does not use, which a CPU-only torch cannot load) and registers two
# Enums with torch's pytree the deprecated way. Each is one matched message of one logger.
NOISE = {
    "torchao": re.compile(r"Failed to load .*/torchao/_C\w*\.\S*so: |Skipping import of cpp extensions"),
    "torch.utils._pytree": re.compile(r"<enum '\w+'> is an Enum subclass and is now natively supported"),
}


class _DropMatching(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_known_noise() -> None:
    """Drop the messages of NOISE (once per process; every other message of those loggers passes)."""
    for name, pattern in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))
