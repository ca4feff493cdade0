"""distzo inside the training scripts users already have: `ZOTrainer` (transformers' Trainer) and
`ZOSFTTrainer` (TRL's SFTTrainer), whose training steps run on distzo's engine (docs/hf.md).

    from distzo.hf import ZOTrainer, ZOArguments
    trainer = ZOTrainer(model=model, args=TrainingArguments(...), train_dataset=..., zo_args=ZOArguments(...))

transformers and trl are optional: `pip install distzo[hf]`."""

from __future__ import annotations

from typing import Any

from .arguments import ZOArguments
from .trainer import ZOTrainerError

__all__ = ["ZOArguments", "ZOSFTTrainer", "ZOTrainer", "ZOTrainerError"]


def __getattr__(name: str) -> Any:
    # The classes subclass transformers' and TRL's trainers: built when first asked for, so that
    # importing distzo.hf (and ZOArguments) needs neither trl nor the Trainer's machinery.
    from . import trainer

    if name == "ZOTrainer":
        cls = trainer._make_zo_trainer()
    elif name == "ZOSFTTrainer":
        try:
            cls = trainer._make_zo_sft_trainer()
        except ImportError as exc:
            raise ImportError(f"ZOSFTTrainer needs TRL ({exc}); pip install 'distzo[hf]' or pip install trl") from None
    else:
        raise AttributeError(name)
    globals()[name] = cls
    return cls
