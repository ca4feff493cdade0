"""The slips a new user makes first, and the formats they bring: override values Hydra's grammar
cannot read (the quoted form distzo prints must be the value they meant), split sizes chosen for a
small file, and the standard SFT record layouts read without settings."""

from __future__ import annotations

import subprocess

import pytest

from distzo.config.compose import shell_quoted_override
from distzo.data.examples import Example
from distzo.data.records import DataError
from distzo.data.splits import make_splits, split_pool
from distzo.data.tasks import PromptTask
from tests.conftest import make_config
from tests.unit.test_tasks import write_jsonl

# --- quoting: the printed fix, typed into a shell and read by Hydra, gives back the value ----------

def bash_words(typed: str) -> list[str]:
    """The words bash makes of a command-line fragment."""
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {typed}"], capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


@pytest.mark.parametrize("value", ["{text} It was", "Review: {text}", "a,b", "it's {x}", 'say "hi" {y}',
                                   "cost $5 `now`", "back\\slash {z}", "[not a list]", "ends\\", "x\\'y {q}"])
def test_the_quoted_form_reads_back_as_the_value(value):
    """What the error line tells the user to type, read by bash as one word and then by Hydra's
    override parser, must yield exactly the original text."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (word,) = bash_words(shell_quoted_override("task.template", value))
    (override,) = OverridesParser.create().parse_overrides([word])
    assert override.key_or_group == "task.template"
    assert override.value() == value


def test_the_quoted_form_composes_into_the_config():
    (word,) = bash_words(shell_quoted_override("task.template", "{text} It was"))
    assert make_config("model=tiny", "task=synthetic-cue", word).task.template == "{text} It was"


# --- split sizes left unset --------------------------------------------------------------------

def pool(n: int) -> list[Example]:
    return [Example(f"p{i}", (" a", " b"), (i % 2,)) for i in range(n)]


@pytest.mark.parametrize("n,sizes", [(300, (240, 30, 30)), (20_000, (18_500, 500, 1000)), (5, (3, 1, 1)),
                                     (9_999, (8_500, 500, 999))])
def test_unset_sizes_take_a_tenth_of_a_small_pool(n, sizes):
    """500 / 1,000, or a tenth of the pool when fewer, at least one each (docs/tasks.md#splits)."""
    s = split_pool(pool(n), None, None, None, 0, "f")
    assert (len(s.train), len(s.validation), len(s.test)) == sizes
    prompts = [e.prompt for e in s.train + s.validation + s.test]
    assert sorted(prompts) == sorted(e.prompt for e in pool(n))  # a partition: nothing lost or repeated


def test_set_sizes_are_used_as_given_and_a_pool_too_small_is_refused():
    s = split_pool(pool(300), 7, 11, None, 0, "f")
    assert (len(s.validation), len(s.test), len(s.train)) == (7, 11, 282)
    with pytest.raises(DataError, match="leaves no training data"):
        split_pool(pool(2), None, None, None, 0, "f")


@pytest.mark.parametrize("name,text", [("empty.jsonl", ""), ("blank.jsonl", "  \n\n"), ("header.csv", "text,label\n"),
                                       ("header.tsv", "text\tlabel\n")])
def test_a_file_without_records_says_so(tokenizer, tmp_path, name, text):
    """Not that the split sizes leave no training data, which no size would fix, nor the datasets
    builder's "Instruction "data" corresponds to no data!" (blank lines, or a header alone)."""
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=rf"^.*{name} holds no records; fill it, or point task.path "
                                        r"\(or task.subset\) at the data$"):
        PromptTask(make_config("task=custom", f"task.path={tmp_path / name}").task, tokenizer)


def test_own_splits_are_cut_and_a_drawn_validation_split_is_a_tenth():
    s = make_splits({"train": pool(200), "test": pool(1500)}, None, None, None, 0, "f")
    assert (len(s.train), len(s.validation), len(s.test)) == (180, 20, 1000)
    s = make_splits({"train": pool(200), "validation": pool(800), "test": pool(50)}, None, None, None, 0, "f")
    assert (len(s.train), len(s.validation), len(s.test)) == (200, 500, 50)


def test_a_300_row_file_splits_without_settings(tokenizer, tmp_path):
    rows = [{"text": f"review {i}", "label": i % 2} for i in range(300)]
    path = write_jsonl(tmp_path / "small.jsonl", rows)
    t = PromptTask(make_config("task=custom", f"task.path={path}").task, tokenizer)
    assert (t.size("train"), t.size("validation"), t.size("test")) == (240, 30, 30)


# --- SFT record layouts ------------------------------------------------------------------------

WORDS = ["cat", "dog", "house", "tree", "car", "book", "sun", "moon", "river", "stone"]


def generation_task(tokenizer, tmp_path, rows, *overrides) -> PromptTask:
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    cfg = make_config("task=custom", "task.kind=generation", f"task.path={path}", "task.val_size=2",
                      "task.test_size=2", *overrides)
    return PromptTask(cfg.task, tokenizer)


def all_examples(t: PromptTask) -> list[Example]:
    return t.splits.train + t.splits.validation + t.splits.test


def test_prompt_and_completion_fields_are_read_as_they_are(tokenizer, tmp_path):
    rows = [{"prompt": f"Say {w}:", "completion": f" {w}!"} for w in WORDS]
    t = generation_task(tokenizer, tmp_path, rows)
    by_prompt = {e.prompt: e for e in all_examples(t)}
    assert set(by_prompt) == {f"Say {w}:" for w in WORDS}
    for w in WORDS:
        e = by_prompt[f"Say {w}:"]
        assert e.candidates == (f" {w}!\n",) and e.answers == (f"{w}!",)  # the completion, then task.stop
    assert t.decodes and "greedy decoding" in t.describe()


def test_a_messages_list_is_rendered_with_the_chat_template(tokenizer, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": w}]}
            for w in WORDS]
    t = generation_task(tokenizer, tmp_path, rows)
    for e in all_examples(t):
        word = e.answers[0]
        want = tokenizer.apply_chat_template([{"role": "user", "content": f"Say {word}"}], tokenize=False,
                                             add_generation_prompt=True)
        assert e.prompt == want and e.candidates == (word + "\n",)


def test_conversational_prompt_completion_uses_the_chat_template_too(tokenizer, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"Say {w}"}],
             "completion": [{"role": "assistant", "content": w}]} for w in WORDS]
    t = generation_task(tokenizer, tmp_path, rows)
    e = next(e for e in all_examples(t) if e.answers == ("moon",))
    assert e.prompt == tokenizer.apply_chat_template([{"role": "user", "content": "Say moon"}], tokenize=False,
                                                     add_generation_prompt=True)


def test_a_text_field_is_language_modelling_on_the_whole_text(tokenizer, tmp_path):
    """No prompt: the text's first token is scored after the tokenizer's document boundary, and every
    token of the text is a target; nothing is decoded, the evaluation is the loss (perplexity)."""
    rows = [{"text": f"the {w} is here"} for w in WORDS]
    t = generation_task(tokenizer, tmp_path, rows)
    assert not t.decodes and "language modelling" in t.describe()
    batch = t.batch("train", [0])
    (seq,) = batch.sequences
    text = t.splits.train[0].candidates[0]
    ids = tokenizer(text, add_special_tokens=False).input_ids
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    assert list(seq.tokens) == [start] + ids
    assert list(seq.targets) == ids and list(seq.scored) == list(range(len(ids)))


def test_the_configured_answer_field_wins_over_a_standard_layout(tokenizer, tmp_path):
    rows = [{"question": f"Q{w}", "answer": w, "text": "ignored"} for w in WORDS]
    t = generation_task(tokenizer, tmp_path, rows, "task.template='{question}'", "task.answers_field=answer")
    assert {e.prompt for e in all_examples(t)} == {f"Q{w}" for w in WORDS}


def test_mixed_layouts_and_missing_fields_are_refused_by_name(tokenizer, tmp_path):
    rows = [{"prompt": "a", "completion": "b"}] * 6 + [{"text": "c"}] * 4
    with pytest.raises(DataError, match=r"record 6 .* has no 'completion' \(the answer\), though other records do; "
                                        r"give every record its answer, or set task.answers_field"):
        generation_task(tokenizer, tmp_path, rows, "task.val_size=1", "task.test_size=1")
    with pytest.raises(DataError, match="no record of .* has an answer.*prompt and completion fields"):
        generation_task(tokenizer, tmp_path, [{"q": w} for w in WORDS])
