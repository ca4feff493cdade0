"""Generation tasks: the completion loss against the stock transformers loss with the prompt masked,
chat rendering, greedy decoding (cached) against a plain argmax loop, decoding through the engine,
the decoding objectives, and the QA presets on fixtures in their distributed formats."""

from __future__ import annotations

import json

import pytest
import torch

from distzo.data.batches import Scores
from distzo.data.decoding import answer_text, greedy_decode
from distzo.data.objectives import objective_sums
from distzo.data.records import DataError
from distzo.data.tasks import PromptTask
from distzo.engine import resident_engine
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.zo.directions import Directions
from distzo.zo.estimators import CLEAN, Probe
from distzo.zo.params import TrainableParams
from tests.conftest import make_config
from tests.unit.test_tasks import write_jsonl

PAIRS = [{"prompt": f"Translate {w} to French:", "completion": f"le {w}"} for w in
         ["cat", "dog", "house", "tree", "car", "book", "sun", "moon", "river", "stone", "bread", "water"]]
SFT = ("task=custom", "task.kind=generation", "task.template='{prompt}'", "task.answers_field=completion",
       "task.val_size=2", "task.test_size=2")


def sft_task(tokenizer, tmp_path, *overrides, objective="loss"):
    path = write_jsonl(tmp_path / "sft.jsonl", PAIRS)
    return PromptTask(make_config(*SFT, f"task.path={path}", *overrides).task, tokenizer, objective)


def tiny(dtype=torch.float64):
    model = random_model("llama", 49152, {}, 0, dtype)
    return model, resident_engine(model, adapter_for(model), TrainableParams.from_model(model), Directions(0))


def test_the_completion_loss_is_the_stock_loss_with_the_prompt_masked(tokenizer, tmp_path):
    """Teacher forcing on " <completion>\\n": (loss sum, token count) over the batch equals the stock
    model's loss with labels -100 on every prompt token (and on the right padding). transformers takes
    its loss from float32 logits even for a float64 model: agreement to float32 rounding, 1e-6
    relative; a prompt token counted, or a target off by one position, is off by O(1)."""
    task = sft_task(tokenizer, tmp_path)
    model, engine = tiny()
    batch = task.batch("train", range(6))
    with engine.materialized() as weights:
        total, count = objective_sums(weights.score(batch), batch).tolist()
    rows = [(task._prompts["train"][i], task._candidates["train"][i][0]) for i in range(6)]
    assert all(tokenizer.decode(c).endswith("\n") and tokenizer.decode(c).startswith(" le ") for _, c in rows)
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(6, width, dtype=torch.long)
    labels = torch.full((6, width), -100)
    mask = torch.zeros(6, width, dtype=torch.long)
    for r, (p, c) in enumerate(rows):
        ids[r, :len(p) + len(c)] = torch.tensor(p + c)
        labels[r, len(p):len(p) + len(c)] = torch.tensor(c)
        mask[r, :len(p) + len(c)] = 1
    with torch.inference_mode():
        stock = float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)
    assert count == sum(len(c) for _, c in rows)
    assert abs(total / count - stock) < 1e-6 * stock


def test_chat_messages_render_with_the_tokenizers_template(tokenizer, tmp_path):
    chats = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w}]}
             for w in ["yes", "no", "maybe", "never", "always", "soon", "later", "now"]]
    path = write_jsonl(tmp_path / "chat.jsonl", chats)
    task = PromptTask(make_config("task=custom", "task.kind=generation", f"task.path={path}",
                                  "task.messages_field=messages", "task.val_size=2", "task.test_size=2").task,
                      tokenizer)
    ex = task.splits.train[0]
    user = ex.prompt.split("user\n")[1].split("<|im_end|>")[0]
    want = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    assert ex.prompt == want and ex.prompt.endswith("<|im_start|>assistant\n")
    assert ex.candidates == (ex.answers[0] + "\n",)


def plain_greedy(model, prompt, n):
    """Argmax decoding with a full forward per token (no cache): the reference."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_cached_greedy_decoding_equals_a_full_forward_per_token(tokenizer):
    model, _ = tiny()
    prompts = [tokenizer(t).input_ids for t in ["Once upon a time", "Q: hello A:", "x"]]
    got = greedy_decode(model, tokenizer, prompts, 6, "", tokenizer.pad_token_id)  # left padding, batched, cached
    for p, text in zip(prompts, got):
        assert text == answer_text(tokenizer, plain_greedy(model, p, 6), "")


def test_decoding_through_the_engine_equals_the_stock_model(tokenizer, tmp_path):
    """The decoding objective's path (a walk per token, no cache) at the clean weights gives the
    tokens of a plain argmax loop; and its F1 objective is minus the sum of the answers' F1."""
    task = sft_task(tokenizer, tmp_path, "task.max_new_tokens=4", objective="f1")
    model, engine = tiny()
    batch = task.train_batch(range(5))
    assert batch.readout == "decode" and batch.decode_tokens == 4
    with engine.materialized():
        pass
    scores = engine.run_probes(batch, [Probe(CLEAN, 0)], 0)[0]
    for seq, generated in zip(batch.sequences, scores.generated):
        assert generated == plain_greedy(model, seq.tokens, 4)
    from distzo.data.answers import f1_score

    want = sum(f1_score(answer_text(tokenizer, g, "\n"), ok) for g, ok in zip(scores.generated, batch.extra["answers"]))
    assert task.objective_sums(scores, batch, "f1").tolist() == [-want, 5.0]


def test_the_decoding_objectives_score_known_generations(tokenizer, tmp_path):
    """Scores with chosen generated tokens (the random model's own answers score 0): minus the sum of
    the hand-computed SQuAD F1 / exact match of each answer, cut at the stop text and normalised."""
    task = sft_task(tokenizer, tmp_path, objective="f1")
    assert task.stop == "\n"
    batch = task.train_batch(range(5))
    gold = [answers[0] for answers in batch.extra["answers"]]  # "le <word>"
    assert all(g.startswith("le ") and len(g.split()) == 2 for g in gold)
    texts = [f" {gold[0]}\n",                    # right: F1 1, EM 1
             f" {gold[1]}\nle cat le dog",       # right up to the stop text: F1 1, EM 1
             " le zzz\n",                        # one of two words right: P = R = 1/2, F1 1/2, EM 0
             f" The {gold[3].upper()}!\n",       # right once normalised (article, case, punctuation)
             " nothing at all"]                  # wrong: F1 0, EM 0
    generated = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    zeros = torch.zeros(5, dtype=torch.float64)
    scores = Scores(zeros, zeros, None, generated)
    assert task.objective_sums(scores, batch, "f1").tolist() == [-3.5, 5.0]
    assert task.objective_sums(scores, batch, "exact_match").tolist() == [-3.0, 5.0]


# --- the QA presets on fixtures in their distributed formats -----------------------------------------

def test_squad_reads_its_distributed_json_and_the_datasets_export(tokenizer, tmp_path):
    def article(i):
        return {"title": f"Topic{i}", "paragraphs": [{"context": f"Context {i}.", "qas": [
            {"id": f"{i}a", "question": f" What is {i}? ", "answers": [{"text": f"thing {i}", "answer_start": 0},
                                                                       {"text": f"the thing {i}", "answer_start": 0}]},
            {"id": f"{i}b", "question": "Who?", "answers": [{"text": "nobody", "answer_start": 3}]}]}]}
    folder = tmp_path / "SQuAD"
    folder.mkdir()
    (folder / "train-v1.1.json").write_text(json.dumps({"version": "1.1", "data": [article(i) for i in range(6)]}))
    (folder / "dev-v1.1.json").write_text(json.dumps({"version": "1.1", "data": [article(i) for i in range(6, 8)]}))
    task = PromptTask(make_config("task=squad", f"task.path={folder}", "task.val_size=2").task, tokenizer)
    assert (task.size("train"), task.size("validation"), task.size("test")) == (10, 2, 4)
    ex = next(e for e in task.splits.test if "What is" in e.prompt)
    assert (ex.prompt.startswith("Title: Topic") and "\nContext: Context " in ex.prompt
            and ex.prompt.endswith("?\nAnswer:"))
    assert ex.answers[1] == f"the {ex.answers[0]}" and ex.candidates == (f" {ex.answers[0]}\n",)

    import datasets

    rows = [{"id": str(i), "title": "T", "context": "C", "question": f"q{i}",
             "answers": {"text": [f"a{i}"], "answer_start": [0]}} for i in range(8)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "export"))
    task = PromptTask(make_config("task=squad", f"task.path={tmp_path / 'export'}", "task.val_size=2",
                                  "task.test_size=2").task, tokenizer)
    assert {e.answers for e in task.splits.train} <= {(f"a{i}",) for i in range(8)}
    assert (task.size("train"), task.size("validation"), task.size("test")) == (4, 2, 2)
    everything = task.splits.train + task.splits.validation + task.splits.test
    assert sorted(e.answers for e in everything) == [(f"a{i}",) for i in range(8)]  # each row once
    assert all(e.prompt.endswith(f"Question: q{e.answers[0][1:]}\nAnswer:") for e in everything)  # its own answer


def test_drop_reads_its_distributed_json(tokenizer, tmp_path):
    def qa(i):
        answers = [{"number": str(i), "date": {"day": "", "month": "", "year": ""}, "spans": []},
                   {"number": "", "date": {"day": "3", "month": "May", "year": "1999"}, "spans": []},
                   {"number": "", "date": {"day": "", "month": "", "year": ""}, "spans": ["Bob", "Al"]}]
        return {"question": f"How many {i}?", "answer": answers[i % 3], "query_id": str(i),
                "validated_answers": [answers[i % 3]]}
    passages = {f"p{j}": {"passage": f"Passage {j}.", "qa_pairs": [qa(3 * j + k) for k in range(3)]} for j in range(5)}
    folder = tmp_path / "drop"
    folder.mkdir()
    (folder / "drop_dataset_train.json").write_text(json.dumps(dict(list(passages.items())[:4])))
    (folder / "drop_dataset_dev.json").write_text(json.dumps(dict(list(passages.items())[4:])))
    task = PromptTask(make_config("task=drop", f"task.path={folder}", "task.val_size=2").task, tokenizer)
    answers = {e.answers for e in task.splits.train + task.splits.validation + task.splits.test}
    assert ("3 May 1999",) in answers and ("Bob", "Al") in answers and ("0",) in answers
    assert task.size("test") == 3 and task.splits.test[0].prompt.startswith("Passage: Passage 4.\nQuestion: How many")


def test_trivia_reads_the_installed_wheels_lists(tokenizer, tmp_path):
    task = PromptTask(make_config("task=trivia", "task.subsets=[worldcapitals]", "task.val_size=20",
                                  "task.test_size=20").task, tokenizer)
    everything = task.splits.train + task.splits.validation + task.splits.test
    assert len(everything) > 150 and all(e.prompt.startswith("Question: ") and e.prompt.endswith("\nAnswer:")
                                          for e in everything)
    afghanistan = [e for e in everything if "capital of Afghanistan" in e.prompt]
    assert afghanistan and afghanistan[0].answers == ("Kabul",) and afghanistan[0].candidates == (" Kabul\n",)
    folder = tmp_path / "lists"
    folder.mkdir()
    (folder / "mine.yaml").write_text("AUTHOR: me\nWhat is 2+2?:\n- 4\n- four\nRed or blue?:\n- red\n" * 1)
    with pytest.raises(DataError, match=r"task.subsets=\['nope'\]: no list 'nope' in .*available: mine"):
        PromptTask(make_config("task=trivia", f"task.path={folder}", "task.subsets=[nope]").task, tokenizer)
