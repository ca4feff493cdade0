"""A transformers Trainer script, as transformers' documentation writes one, trained by zeroth-order
steps: the two changed lines are marked `# ZO`. Everything else (the model, a `datasets` Dataset, the
tokenizer, the collator, TrainingArguments, compute_metrics, a callback) is the usual.

    python examples/hf_trainer.py --model HuggingFaceTB/SmolLM2-135M --output runs/hf-zo
    torchrun --nproc-per-node 4 examples/hf_trainer.py --model ... --mesh 2x2   # a 2 x 2 mesh (docs/hf.md)
    torchrun --nproc-per-node 4 examples/hf_trainer.py --model ... --use-cpu    # Trainer's processes on CPUs

The data: short texts with a pattern for the language-modelling loss to learn ("The word is apple.
Repeat it: apple").
"""

from __future__ import annotations

import argparse

import numpy as np
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    TrainerCallback,
    TrainingArguments,
)

from distzo.hf import ZOArguments, ZOTrainer  # ZO: instead of `from transformers import Trainer`


class CountEvents(TrainerCallback):
    """Counts the callback events a run fires (the test reads them)."""

    def __init__(self):
        self.events: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.events[name] = self.events.get(name, 0) + 1

    def on_train_begin(self, args, state, control, **kwargs):
        self._count("train_begin")

    def on_step_end(self, args, state, control, **kwargs):
        self._count("step_end")

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._count("log")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._count("evaluate")

    def on_save(self, args, state, control, **kwargs):
        self._count("save")

    def on_train_end(self, args, state, control, **kwargs):
        self._count("train_end")


WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon", "north", "glass"]


def sentences(n: int) -> list[str]:
    """Short texts with a pattern to learn: a word, then the same word repeated."""
    return [f"The word is {w}. Repeat it: {w}" for w in (WORDS * (n // len(WORDS) + 1))[:n]]


def compute_metrics(eval_pred) -> dict[str, float]:
    """Next-token accuracy on the labelled positions."""
    logits, labels = eval_pred
    predictions = np.argmax(logits[:, :-1], axis=-1)
    targets = labels[:, 1:]
    scored = targets != -100
    return {"token_accuracy": float((predictions[scored] == targets[scored]).mean())}


def build(model_path: str, output: str, steps: int, mesh: str | None, seed: int = 0, callbacks=(), n: int = 96,
          optimizer: str = "sgd", lr: float = 1e-3, save_steps: int = 0, per_device: int = 4, accumulation: int = 4,
          estimator: str = "mezo", training: dict | None = None, **zo_settings):
    """The Trainer of this script. training: TrainingArguments to set or change (`eval_steps=4`,
    `load_best_model_at_end=True`). zo_settings: further ZOArguments fields (an estimator's or
    optimizer's settings: `rank=2`, `optim_beta2=0.99`)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path)
    texts = sentences(n)
    data = Dataset.from_dict({"text": texts}).map(lambda b: tokenizer(b["text"], truncation=True, max_length=64),
                                                  batched=True, remove_columns=["text"])
    split = data.train_test_split(test_size=16, seed=0)
    settings = dict(output_dir=output, max_steps=steps, per_device_train_batch_size=per_device,
                    gradient_accumulation_steps=accumulation, learning_rate=lr, lr_scheduler_type="constant",
                    logging_steps=2, eval_strategy="steps", eval_steps=max(1, steps // 2),
                    save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, save_total_limit=2,
                    per_device_eval_batch_size=8, seed=seed, report_to=[])
    args = TrainingArguments(**{**settings, **(training or {})})
    return ZOTrainer(  # ZO: instead of Trainer(
        model=model, args=args, train_dataset=split["train"], eval_dataset=split["test"],
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), processing_class=tokenizer,
        compute_metrics=compute_metrics, callbacks=list(callbacks),
        zo_args=ZOArguments(estimator=estimator, optimizer=optimizer, q=2, mesh=mesh, **zo_settings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a hub id or a local causal-LM folder")
    parser.add_argument("--output", default="runs/hf-zo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mesh", default=None, help="P x D (default: 1 x the launched processes)")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--per-device", type=int, default=4, help="examples per data rank and accumulation step")
    parser.add_argument("--accumulation", type=int, default=4, help="gradient_accumulation_steps (micro-batches)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output")
    parser.add_argument("--load-best", metavar="METRIC", default=None,
                        help="end with the checkpoint of the best evaluation by METRIC (loss: the lowest; "
                             "token_accuracy: the highest), evaluating and saving every --save-steps")
    parser.add_argument("--greater-is-better", action="store_true", default=None,
                        help="with --load-best: the highest METRIC is the best (default: loss the lowest, "
                             "any other metric the highest)")
    parser.add_argument("--use-cpu", action="store_true",
                        help="TrainingArguments(use_cpu=True): on CPUs under torchrun, Trainer's own processes are the "
                             "launched ones (its evaluation split among them)")
    ns = parser.parse_args()
    if ns.load_best and not ns.save_steps:
        parser.error("--load-best needs --save-steps (the cadence of the evaluations and checkpoints it chooses among)")
    counter = CountEvents()
    training = dict(use_cpu=True) if ns.use_cpu else {}
    if ns.load_best:
        training.update(load_best_model_at_end=True, metric_for_best_model=ns.load_best,
                        greater_is_better=ns.greater_is_better, eval_steps=ns.save_steps, save_total_limit=1)
    trainer = build(ns.model, ns.output, ns.steps, ns.mesh, callbacks=[counter], save_steps=ns.save_steps,
                    per_device=ns.per_device, accumulation=ns.accumulation, training=training)
    result = trainer.train(resume_from_checkpoint=True if ns.resume else None)
    metrics = trainer.evaluate()
    trainer.save_model(f"{ns.output}/final")
    if trainer.is_world_process_zero():
        print({"train_loss": result.training_loss, **metrics, "events": counter.events}, flush=True)


if __name__ == "__main__":
    main()
