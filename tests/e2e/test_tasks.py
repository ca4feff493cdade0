"""Tasks end to end: training from a file of every supported format, multiple choice through the
driver, and `python -m distzo eval` against a run's own final evaluation, on one rank and sharded."""

from __future__ import annotations

import json

import pytest

from distzo.run.training import train
from distzo.telemetry.jsonl import read_jsonl
from tests.conftest import make_config
from tests.distributed.launch import run_forked
from tests.unit.test_tasks import THREE_CLASS, reviews_in, write_jsonl

FAST = ("model=tiny", "eval_every=0", "log_every=1000", "checkpoint.every=0", "batch_size=4")


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "tsv", "parquet", "save_to_disk"])
def test_training_runs_on_a_file_of_every_format(tmp_path, fmt):
    path = reviews_in(fmt, tmp_path)
    out = tmp_path / "run"
    summary = train(make_config(*FAST, *THREE_CLASS, f"task.path={path}", "task.val_size=2", "task.test_size=3",
                                "steps=3", "save_final=false"), out)
    records = read_jsonl(out / "metrics.jsonl")
    steps = [r["step"] for r in records if r["type"] == "train"]
    assert steps == [1, 2, 3] and 0 <= summary["test_accuracy"] <= 1
    tested = [r for r in records if r["type"] == "eval" and r["split"] == "test"][-1]
    assert tested["step"] == 3 and tested["examples"] == 3  # task.test_size=3
    assert summary["test_accuracy"] == tested["accuracy"]
    assert tested["accuracy"] * 3 == pytest.approx(round(tested["accuracy"] * 3), abs=1e-9)  # k of 3 right


def quiz(tmp_path, n=400, learnable=False):
    """A multiple-choice file: the right option repeats the question's last word. learnable: the right
    option is also always one of five words and the wrong ones of five others, a cue a randomly
    initialised tiny model learns in a hundred ZO steps (repeating the question's word, it does not)."""
    import random

    rng = random.Random(0)
    words = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon", "north", "glass"]
    rows = []
    for _ in range(n):
        target = rng.choice(words[:5] if learnable else words)
        options = rng.sample([w for w in (words[5:] if learnable else words) if w != target], 3)
        answer = rng.randrange(4)
        options.insert(answer, target)
        rows.append({"question": f"say {target}", "options": options, "answer": answer})
    return write_jsonl(tmp_path / "quiz.jsonl", rows)


MC = ("task=custom", "task.kind=multiple_choice", "task.template='Question: {question}. Answer:'",
      "task.candidates_field=options", "task.label_field=answer", "task.val_size=40", "task.test_size=40")


@pytest.mark.parametrize("loss,lr", [("teacher_forcing", 3e-4), ("classification", 1e-3)])
def test_multiple_choice_training_learns(tmp_path, loss, lr):
    """Both of MeZO's losses train on a learnable four-option file (`quiz(learnable=True)`): teacher
    forcing lowers the right option's token loss (a full-vocabulary loss near ln 49152 = 10.8 at the
    start: 100 steps took it down by 0.39-0.54 over seeds 0-3), and the classification loss lifts
    validation accuracy from 0 to far above chance (0.25): 1.0 after 100 steps for seeds 0-5. (On
    the plain quiz, whose cue needs the question's word copied, 150 steps left it at 0.2-0.475.)"""
    out = tmp_path / loss
    summary = train(make_config(*FAST, *MC, f"task.path={quiz(tmp_path, learnable=True)}", f"task.loss={loss}",
                                "steps=100", "batch_size=8", f"optim.lr={lr}", "save_final=false"), out)
    records = read_jsonl(out / "metrics.jsonl")
    losses = [r["loss"] for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval" and r["split"] == "validation"]
    assert summary["validation_accuracy_after"] == evals[-1]["accuracy"]
    if loss == "teacher_forcing":
        assert sum(losses[-30:]) / 30 < sum(losses[:30]) / 30 - 0.2, (losses[:30], losses[-30:])
    else:
        assert evals[-1]["accuracy"] >= 0.75 and evals[0]["accuracy"] <= 0.25, evals


def trained(tmp_path, name: str, *args: str):
    """A training run (forked, as the CLI runs it): its directory, summary and final test evaluation."""
    run_dir = tmp_path / name
    r = run_forked(1, ["train", *FAST, *args, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    tested = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["type"] == "eval" and m["split"] == "test"][-1]
    return run_dir, summary, tested


def test_eval_of_a_runs_final_folder_reports_the_runs_own_final_evaluation(tmp_path):
    run_dir, summary, tested = trained(tmp_path, "run", *MC, f"task.path={quiz(tmp_path)}", "steps=20", "optim.lr=2e-3")
    for nproc in (1, 2):  # on one rank, and its batches dealt over two
        out = tmp_path / f"eval-{nproc}"
        r = run_forked(nproc, ["eval", f"eval.run={run_dir}", f"hydra.run.dir={out}"], cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads((out / "eval.json").read_text())
        assert got["split"] == "test" and got["examples"] == tested["examples"] == 40
        assert got["accuracy"] == summary["test_accuracy"] == tested["accuracy"]
        assert got["loss"] == pytest.approx(tested["loss"], rel=1e-6)  # float sums in another order
        assert f"test: accuracy {got['accuracy']:.4f}" in r.stdout


def test_eval_of_an_adapter_run_loads_the_adapter_on_the_runs_base_model(tmp_path):
    run_dir, summary, tested = trained(tmp_path, "lora", "task=synthetic-cue", "task.val_size=16", "task.test_size=16",
                                       "peft=lora", "optim.lr=1e-2", "estimator.eps=1e-2", "steps=10")
    assert (run_dir / "final" / "adapter.safetensors").is_file()
    out = tmp_path / "eval"
    r = run_forked(1, ["eval", f"eval.run={run_dir}", f"hydra.run.dir={out}"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((out / "eval.json").read_text())
    assert got["accuracy"] == summary["test_accuracy"] and got["loss"] == pytest.approx(tested["loss"], rel=1e-6)
    # without the adapter (the base model alone) the loss differs: the adapter was really loaded
    r = run_forked(1, ["eval", *FAST, "task=synthetic-cue", "task.val_size=16", "task.test_size=16",
                       f"hydra.run.dir={tmp_path / 'base'}"], cwd=tmp_path)
    assert json.loads((tmp_path / "base" / "eval.json").read_text())["loss"] != pytest.approx(tested["loss"], rel=1e-6)
    peft_adapter_gives_distzos_logits(run_dir, "task=synthetic-cue", "peft=lora")
    import distzo

    for rebase in ("model=tiny-opt", "model.init_seed=5"):  # the adapter on another base: refused, nothing written
        with pytest.raises(distzo.ConfigError, match=rf"puts the run's adapter .*, and {rebase.split('=')[0]}= on "
                                                     "the command line would put it on another"):
            distzo.evaluate(run=run_dir, run_dir=tmp_path / rebase, overrides=[rebase])
        assert not (tmp_path / rebase).exists()


def test_lora_on_gpt2s_conv1d_projections_exports_a_peft_adapter(tmp_path):
    """GPT-2's projections are transformers' Conv1D (weight stored [in, out]): LoRA attaches to them
    like to nn.Linear, trains on the general path, and its PEFT export (fan_in_fan_out) gives distzo's
    logits."""
    gpt2 = ("model.arch=gpt2", "task=synthetic-cue", "peft=lora", "peft.targets=[c_attn,c_proj]")
    run_dir, summary, _ = trained(tmp_path, "gpt2", *gpt2, "task.val_size=16", "task.test_size=16", "optim.lr=1e-2",
                                  "estimator.eps=1e-2", "steps=6")
    assert summary["trainable_parameters"] > 0
    peft_adapter_gives_distzos_logits(run_dir, *gpt2)


def peft_adapter_gives_distzos_logits(run_dir, *settings):
    """The run's final/ also holds a PEFT adapter: `peft.PeftModel.from_pretrained` on the stock base
    model gives the label-word logits distzo's own evaluation of the trained adapter gives. distzo
    packs the prompts into one row, PEFT runs each alone (other matmul shapes): float32 rounding,
    1e-5 against logits of O(1); an adapter not applied, or applied twice, is off by the update."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file

    from distzo.models.loading import load_model
    from distzo.models.quantize import quantize_base
    from distzo.parallel.mesh import Mesh
    from distzo.run.components import build_components
    from distzo.state.saved import final_weights

    cfg = make_config(*FAST, *settings, "task.val_size=16", "task.test_size=16")
    c = build_components(cfg, Mesh.single(), 0, weights=load_file(str(final_weights(run_dir))))
    batch = c.task.batch("validation", list(range(8)))
    with c.engine.materialized() as weights:
        ours = weights.score(batch).logits
    c.close()
    stock, _ = load_model(cfg.model)
    quantize_base(stock, cfg.model.quantize)  # a quantized base is quantized again, the same way (deterministic)
    peft_model = PeftModel.from_pretrained(stock, str(run_dir / "final")).eval()
    labels = batch.candidates
    with torch.inference_mode():
        theirs = torch.stack([peft_model(input_ids=torch.tensor([s.tokens])).logits[0, -1, labels]
                              for s in batch.sequences])
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    with peft_model.disable_adapter(), torch.inference_mode():
        bare = torch.stack([peft_model(input_ids=torch.tensor([s.tokens])).logits[0, -1, labels]
                            for s in batch.sequences])
    assert float((bare - ours).abs().max()) > 1e-4  # the adapter moved the logits: it was really loaded


def test_eval_with_demonstrations_is_a_zero_training_baseline(tmp_path):
    out = tmp_path / "icl"
    r = run_forked(1, ["eval", *FAST, *MC, f"task.path={quiz(tmp_path)}", "task.demos=3", "eval.split=validation",
                       f"hydra.run.dir={out}"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((out / "eval.json").read_text())
    assert got["demos"] == 3 and got["split"] == "validation" and got["examples"] == 40
    assert "3 solved examples before each prompt" in r.stderr + r.stdout


def test_sft_on_prompt_completion_pairs_lowers_the_completion_loss(tmp_path):
    """Generation by teacher forcing on a small file of prompt / completion pairs (the completion's
    tokens only; the prompt is context): the validation completion loss falls, and the evaluation
    reports exact match and F1 of greedy answers."""
    pairs = [{"prompt": f"The word is {w}. Repeat it:", "completion": w} for w in
             ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon", "north", "glass"] * 12]
    path = write_jsonl(tmp_path / "sft.jsonl", pairs)
    out = tmp_path / "sft"
    train(make_config(*FAST, "task=custom", "task.kind=generation", f"task.path={path}", "task.template='{prompt}'",
                      "task.answers_field=completion", "task.val_size=20", "task.test_size=20", "task.max_new_tokens=4",
                      "steps=120", "batch_size=8", "optim.lr=3e-4", "save_final=false"), out)
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "eval" and r["split"] == "validation"]
    assert evals[-1]["loss"] < evals[0]["loss"] - 0.1, evals
    assert {"exact_match", "f1", "accuracy"} <= evals[-1].keys() and evals[-1]["accuracy"] == evals[-1]["exact_match"]


def test_objective_f1_trains_on_decoded_answers(tmp_path):
    """objective=f1 on model=tiny: each step decodes answers under both perturbations and differences
    minus their mean F1; the train lines carry it as the loss."""
    rows = [{"question": f"say {w}", "answers": [w]} for w in ["yes", "no", "up", "down", "left", "right"] * 8]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    out = tmp_path / "f1"
    train(make_config(*FAST, "task=custom", "task.kind=generation", f"task.path={path}",
                      "task.template='Q: {question} A:'", "task.val_size=6", "task.test_size=6",
                      "task.max_new_tokens=3", "objective=f1", "steps=3", "save_final=false"), out)
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(-1.0 <= r["loss"] <= 0.0 for r in steps)
