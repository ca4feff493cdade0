"""A TRL SFT script, as TRL's documentation writes one, trained by zeroth-order steps: the two changed
lines are marked `# ZO`. The data is prompt/completion pairs (TRL's conversational and plain text
formats work the same way); TRL masks the prompt (completion-only loss) and attaches the LoRA adapter
of `peft_config`, whose parameters are the only ones ZO trains.

    python examples/trl_sft.py --model HuggingFaceTB/SmolLM2-135M --output runs/sft-zo
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig

from distzo.hf import ZOArguments, ZOSFTTrainer  # ZO: instead of `from trl import SFTTrainer`

CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Chile", "Santiago"),
            ("Cuba", "Havana"), ("Greece", "Athens"), ("Poland", "Warsaw"), ("Canada", "Ottawa"),
            ("Ireland", "Dublin"), ("Portugal", "Lisbon")]


def pairs() -> Dataset:
    return Dataset.from_dict({"prompt": [f"The capital of {country} is" for country, _ in CAPITALS],
                              "completion": [f" {city}." for _, city in CAPITALS]})


def build(model_path: str, output: str, steps: int, mesh: str | None = None, eval_dataset: Dataset | None = None,
          training: dict | None = None):
    """The trainer of this script. training: SFTConfig arguments to set or change (with an
    eval_dataset: `eval_strategy="steps"`, `load_best_model_at_end=True`)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path)
    settings = dict(output_dir=output, max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-2,
                    lr_scheduler_type="constant", logging_steps=2, save_strategy="no", report_to=[], seed=0,
                    completion_only_loss=True, max_length=32, bf16=torch.cuda.is_available())
    args = SFTConfig(**{**settings, **(training or {})})
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return ZOSFTTrainer(  # ZO: instead of SFTTrainer(
        model=model, args=args, train_dataset=pairs(), eval_dataset=eval_dataset, processing_class=tokenizer,
        peft_config=peft_config,
        zo_args=ZOArguments(q=2, mesh=mesh))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a hub id or a local causal-LM folder")
    parser.add_argument("--output", default="runs/sft-zo")
    parser.add_argument("--steps", type=int, default=30)
    ns = parser.parse_args()
    trainer = build(ns.model, ns.output, ns.steps)
    result = trainer.train()
    trainer.save_model(f"{ns.output}/adapter")  # the LoRA adapter, in PEFT's format
    if trainer.is_world_process_zero():
        print({"train_loss": result.training_loss}, flush=True)


if __name__ == "__main__":
    main()
