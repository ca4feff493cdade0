"""ZOTrainer where a Trainer user expects Trainer's behaviour (docs/hf.md): distzo's own LoRA saved so that
from_pretrained gives the trained model; predict() at the current weights; one log a step; a resume
with a longer run under the linear schedule, and a refused one worded in TrainingArguments' terms;
positional arguments bound as Trainer binds them. And refused in one line, before anything is written,
what a ZO step would train differently from what Trainer's evaluation scores: a subclass's own
compute_loss, a mixture of experts' router loss, data whose labels or rows transformers' loss reads
otherwise, a streaming dataset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.test_hf import save_tiny_llama

WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon", "north", "glass"]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def data(model_folder):
    """A tokenizer and 16 tokenized training / 8 evaluation examples."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    texts = [f"The word is {w}. Repeat it: {w}" for w in WORDS * 3][:24]
    rows = Dataset.from_dict({"text": texts}).map(lambda b: tokenizer(b["text"]), batched=True,
                                                  remove_columns=["text"])
    return tokenizer, rows.select(range(16)), rows.select(range(16, 24))


def zo_trainer(model_folder, data, out, *, zo_args=None, collator=None, train_dataset=None, model=None, **settings):
    from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, TrainingArguments

    from distzo.hf import ZOArguments, ZOTrainer

    tokenizer, train, held_out = data
    args = TrainingArguments(**{"output_dir": str(out), "per_device_train_batch_size": 4, "learning_rate": 1e-3,
                                "report_to": [], "per_device_eval_batch_size": 8, "seed": 0, "disable_tqdm": True,
                                **settings})
    return ZOTrainer(model=model or AutoModelForCausalLM.from_pretrained(model_folder), args=args,
                     train_dataset=train if train_dataset is None else train_dataset, eval_dataset=held_out,
                     data_collator=collator or DataCollatorForLanguageModeling(tokenizer, mlm=False),
                     processing_class=tokenizer, zo_args=zo_args or ZOArguments(q=1))


def logits(model, ids=((1, 2, 3, 4, 5, 6),)):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


def test_distzo_lora_saved_by_save_model_loads_with_from_pretrained(model_folder, data, tmp_path):
    """ZOArguments(peft="lora") attaches distzo's LoRA; save_model writes it beside the model as a PEFT
    adapter too, which from_pretrained(folder) loads onto the saved base: the trained model. PEFT's
    LoRA forward (W x + s B (A x)) and distzo's hook compute the same products in another order over
    a 64-wide hidden size: float32 agreement to 1e-5."""
    from transformers import AutoModelForCausalLM

    from distzo.hf import ZOArguments

    trainer = zo_trainer(model_folder, data, tmp_path / "out", zo_args=ZOArguments(q=1, peft="lora"), max_steps=3,
                         learning_rate=5e-2)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "adapter_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    trained, untrained = logits(trainer.model), logits(AutoModelForCausalLM.from_pretrained(model_folder))
    assert torch.allclose(logits(loaded), trained, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(untrained, trained, atol=1e-4)  # B moved from zero: the adapter holds the training


def test_predict_in_a_callback_sees_the_weights_evaluate_sees(model_folder, data, tmp_path):
    """predict() while training runs, as evaluate(): at the current weights (distzo may hold the last
    update back); one log a step, even where an epoch's end asks again (logging_first_step with one
    step an epoch)."""
    from transformers import TrainerCallback

    seen = []

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((trainer.predict(trainer.eval_dataset).metrics["test_loss"],
                         trainer.evaluate()["eval_loss"]))

    trainer = zo_trainer(model_folder, data, tmp_path / "out", train_dataset=data[1].select(range(4)),
                         num_train_epochs=3, logging_strategy="epoch", logging_first_step=True, learning_rate=5e-2)
    trainer.add_callback(Probe())
    trainer.train()
    assert len(seen) == 3 and len({s[1] for s in seen}) == 3  # the weights moved at each step
    assert all(predicted == pytest.approx(evaluated, rel=1e-6) for predicted, evaluated in seen)
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3]


def test_a_checkpoint_resumes_longer_under_the_linear_schedule_and_a_changed_rate_is_refused_in_trainer_terms(
        model_folder, data, tmp_path):
    """Each step's rate is transformers' scheduler's and is logged with it, so a resume with a larger
    max_steps continues (the schedule stretched, as Trainer's), under `linear` as under the others. A
    resume with another learning_rate is refused, naming TrainingArguments' learning_rate."""
    from distzo.hf import ZOTrainerError

    out = tmp_path / "out"
    zo_trainer(model_folder, data, out, max_steps=2, save_steps=2, lr_scheduler_type="linear", logging_steps=1).train()
    longer = zo_trainer(model_folder, data, out, max_steps=4, save_steps=2, lr_scheduler_type="linear",
                        logging_steps=1)
    assert longer.train(resume_from_checkpoint=True).global_step == 4
    rates = [h["learning_rate"] for h in longer.state.log_history if "learning_rate" in h]
    assert rates[-2:] == pytest.approx([1e-3 * 2 / 4, 1e-3 * 1 / 4])  # the linear decay over 4 steps
    other = zo_trainer(model_folder, data, out, max_steps=6, save_steps=2, learning_rate=2e-3)
    with pytest.raises(ZOTrainerError, match=r"learning_rate \(optim.lr\): 0.001 there, 0.002 here\); resume with "
                                             r"the TrainingArguments and ZOArguments .* train without "
                                             r"resume_from_checkpoint"):
        other.train(resume_from_checkpoint=str(out / "checkpoint-4"))


def test_positional_arguments_bind_as_trainers_do(model_folder, data, tmp_path):
    import inspect

    from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from distzo.hf import ZOTrainer

    tokenizer, train, held_out = data
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    positional = (AutoModelForCausalLM.from_pretrained(model_folder), args,
                  DataCollatorForLanguageModeling(tokenizer, mlm=False), train, held_out, tokenizer)
    assert ZOTrainer(*positional).processing_class is tokenizer
    parameters = list(inspect.signature(Trainer.__init__).parameters.values())[1:]
    most = sum(p.kind == p.POSITIONAL_OR_KEYWORD for p in parameters)
    with pytest.raises(TypeError, match=rf"ZOTrainer\(\) takes at most {most} positional arguments \({most + 1} "
                                        r"given\)"):
        ZOTrainer(*positional, *[None] * (most + 1 - len(positional)))
    with pytest.raises(TypeError, match="multiple values for argument 'args'"):
        ZOTrainer(*positional[:2], args=args)


def test_what_would_train_another_loss_than_evaluation_scores_is_refused_at_construction(model_folder, data,
                                                                                         tmp_path):
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, TrainingArguments

    from distzo.hf import ZOArguments, ZOTrainer, ZOTrainerError

    class OwnLoss(ZOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(ZOTrainerError, match="OwnLoss overrides compute_loss, which ZO steps never call"):
        OwnLoss(model=AutoModelForCausalLM.from_pretrained(model_folder),
                args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))
    experts = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               num_local_experts=2, output_router_logits=True))
    with pytest.raises(ZOTrainerError, match=r"output_router_logits=True adds the router's load-balancing loss .*"
                                             r"set model.config.output_router_logits=False"):
        ZOTrainer(model=experts, args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))
    with pytest.raises(ZOTrainerError, match=r"use_cpu=True\) with ZOArguments\(device='cuda'\)"):
        ZOTrainer(model=AutoModelForCausalLM.from_pretrained(model_folder),
                  args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True),
                  zo_args=ZOArguments(device="cuda"))
    with pytest.raises(ZOTrainerError, match="split_batches=True splits per_device_train_batch_size"):
        ZOTrainer(model=AutoModelForCausalLM.from_pretrained(model_folder),
                  args=TrainingArguments(output_dir=str(tmp_path), report_to=[],
                                         accelerator_config={"split_batches": True}))


def test_data_transformers_would_score_otherwise_is_refused_before_anything_is_written(model_folder, data, tmp_path):
    """Checked on the collator's first batch when train() starts: no zo/ written."""
    from transformers import DataCollatorWithFlattening, DataCollatorWithPadding, default_data_collator

    from distzo.hf.data import TrainerDataError

    tokenizer, train, _ = data
    padded = train.map(lambda row: dict(tokenizer(tokenizer.decode(row["input_ids"]), padding="max_length",
                                                  max_length=24, add_special_tokens=False)))
    padded = padded.map(lambda row: {"labels": row["input_ids"]})  # a tutorial's recipe: the padding scored too
    cases = {
        "no labels": (dict(collator=DataCollatorWithPadding(tokenizer)), "the collated batch has no labels"),
        "padding scored": (dict(train_dataset=padded, collator=default_data_collator),
                           r"labels at padded positions \(attention_mask 0\) are not -100"),
        "flattened": (dict(collator=DataCollatorWithFlattening()), "position_ids do not count each row's real"),
        "classification": (dict(train_dataset=train.map(lambda row: {"labels": 1}),
                                collator=DataCollatorWithPadding(tokenizer)), r"labels of shape \[2\] for input_ids"),
        "streaming": (dict(train_dataset=train.to_iterable_dataset()), "is a IterableDataset without len()"),
    }
    for name, (how, message) in cases.items():
        out = tmp_path / name.replace(" ", "-")
        with pytest.raises(TrainerDataError, match=message):
            zo_trainer(model_folder, data, out, max_steps=2, **how).train()
        assert not (out / "zo").exists(), name


def test_a_checkpoint_written_when_zotrainer_passed_the_linear_schedule_on_still_resumes(model_folder, data,
                                                                                        tmp_path):
    """Before each step's rate was the scheduler's alone, ZOTrainer passed `linear` (and the warm-up)
    on as distzo's own schedule, which the resume check records: such a checkpoint (forged here from a
    new one, its fingerprint recomputed) resumes with the settings it was written with."""
    import json

    from distzo.state.resume import _digest

    out = tmp_path / "out"
    zo_trainer(model_folder, data, out, max_steps=4, save_steps=2, logging_steps=1).train()
    state_file = out / "checkpoint-2" / "zo_state" / "state.json"
    state = json.loads(state_file.read_text())
    keys = state["fingerprint_keys"]
    keys["optim"].update(schedule="linear", warmup_steps=0)
    keys["steps"] = 4
    state_file.write_text(json.dumps(dict(state, fingerprint_keys=keys, config_fingerprint=_digest(keys))))
    again = zo_trainer(model_folder, data, out, max_steps=4, save_steps=2, logging_steps=1)
    assert again.train(resume_from_checkpoint=str(out / "checkpoint-2")).global_step == 4
