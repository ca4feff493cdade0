"""Tasks from local files: every supported format, every suite preset on a fixture in the format its
public copy is distributed in, the split protocol, candidate batches, demonstrations, and the errors a
user meets with their own data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distzo.data.records import DataError
from distzo.data.tasks import PromptTask
from distzo.errors import ConfigError
from tests.conftest import make_config

SMALL = ("task.val_size=2", "task.test_size=3")


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_tsv(path: Path, header, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\t".join(header) + "\n" + "".join("\t".join(map(str, r)) + "\n" for r in rows))
    return path


def task(tokenizer, *overrides: str, objective: str = "loss") -> PromptTask:
    cfg = make_config(*overrides)
    return PromptTask(cfg.task, tokenizer, objective)


REVIEWS = [(f"review number {i} was {'good' if i % 3 == 2 else 'bad' if i % 3 == 0 else 'fine'}",
            ["negative", "neutral", "positive"][i % 3]) for i in range(24)]
THREE_CLASS = ("task=custom", "task.template='{text} Overall it was'", "task.label_words=[' bad',' so-so',' good']",
               "task.labels=[negative,neutral,positive]")


def reviews_in(fmt: str, root: Path) -> Path:
    rows = [{"text": t, "label": lab} for t, lab in REVIEWS]
    if fmt == "jsonl":
        return write_jsonl(root / "data.jsonl", rows)
    if fmt == "csv":
        import csv

        with open(root / "data.csv", "w", newline="") as fh:
            writer = csv.DictWriter(fh, ["text", "label"])
            writer.writeheader()
            writer.writerows(rows)
        return root / "data.csv"
    if fmt == "tsv":
        return write_tsv(root / "data.tsv", ["text", "label"], [(r["text"], r["label"]) for r in rows])
    import datasets

    ds = datasets.Dataset.from_list(rows)
    if fmt == "parquet":
        ds.to_parquet(str(root / "data.parquet"))
        return root / "data.parquet"
    if fmt == "save_to_disk":
        datasets.DatasetDict({"train": ds.select(range(18)), "validation": ds.select(range(18, 21)),
                              "test": ds.select(range(21, 24))}).save_to_disk(str(root / "export"))
        return root / "export"
    raise ValueError(fmt)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "tsv", "parquet", "save_to_disk"])
def test_every_format_reads_the_same_examples(tokenizer, tmp_path, fmt):
    t = task(tokenizer, *THREE_CLASS, f"task.path={reviews_in(fmt, tmp_path)}", *SMALL)
    sizes = [t.size(s) for s in ("train", "validation", "test")]
    assert sizes == ([18, 2, 3] if fmt == "save_to_disk" else [19, 2, 3])  # the export's splits, cut to size
    everything = t.splits.train + t.splits.validation + t.splits.test
    by_prompt = {f"{text} Overall it was": ["negative", "neutral", "positive"].index(lab) for text, lab in REVIEWS}
    assert {ex.prompt: ex.label for ex in everything}.items() <= by_prompt.items()
    assert len({ex.prompt for ex in everything}) == sum(sizes)  # disjoint splits
    assert t.label_ids is None  # " so-so" is several tokens: candidates are scored as branches
    batch = t.batch("validation", range(t.size("validation")))
    assert batch.readout == "likelihoods" and batch.units == 3 * batch.size
    assert all(len(s.branches) == 3 for s in batch.sequences)


def test_splits_are_deterministic_and_follow_split_seed(tokenizer, tmp_path):
    path = reviews_in("jsonl", tmp_path)
    a, b = (task(tokenizer, *THREE_CLASS, f"task.path={path}", *SMALL) for _ in range(2))
    c = task(tokenizer, *THREE_CLASS, f"task.path={path}", *SMALL, "task.split_seed=1")
    assert a.splits == b.splits and a.splits.test != c.splits.test


def test_single_token_label_words_use_the_label_word_head(tokenizer, tmp_path):
    """Words of one token each: the head reads their logits at the prompt's last token (the embedded
    default's path); several-token words would make a branched candidate batch instead."""
    path = reviews_in("csv", tmp_path)
    t = task(tokenizer, "task=custom", f"task.path={path}", "task.template='{text} It was'",
             "task.label_words=[' terrible',' okay',' great']", "task.labels=[negative,neutral,positive]", *SMALL)
    batch = t.batch("train", [0, 1])
    assert t.label_ids is not None and batch.readout == "logits" and batch.candidates.tolist() == t.label_ids.tolist()


# --- the suite presets, each on a fixture in its distributed format ----------------------------------

def superglue(root: Path, name: str, train, val, test=None) -> Path:
    folder = root / name
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "val.jsonl", val)
    if test is not None:
        write_jsonl(folder / "test.jsonl", test)
    return folder


def repeat(make, n):
    return [make(i) for i in range(n)]


PRESETS = {}


def preset(name):
    def register(fn):
        PRESETS[name] = fn
        return fn
    return register


@preset("sst2")
def _sst2(root):
    folder = root / "SST-2"
    write_tsv(folder / "train.tsv", ["sentence", "label"], repeat(lambda i: (f"a {i} movie ", i % 2), 10))
    write_tsv(folder / "dev.tsv", ["sentence", "label"], repeat(lambda i: (f'the "dev" {i} film', i % 2), 4))
    write_tsv(folder / "test.tsv", ["index", "sentence"], repeat(lambda i: (i, f"unlabelled {i}"), 3))
    return folder, lambda ex: (ex.prompt.endswith(" It was") and ex.candidates == (" terrible", " great"))


@preset("rte")
def _rte(root):
    row = lambda i: {"premise": f"P{i}.", "hypothesis": f"H{i}.",  # noqa: E731
                     "label": ["entailment", "not_entailment"][i % 2], "idx": i}
    folder = superglue(root, "RTE", repeat(row, 10), repeat(row, 4),
                       repeat(lambda i: {"premise": "p", "hypothesis": "h", "idx": i}, 3))
    return folder, lambda ex: (ex.prompt.endswith('\nDoes this mean that "' + ex.prompt.split('"')[1]
                                                  + '" is true? Yes or No?\n')
                               and ex.candidates == ("Yes", "No"))


@preset("cb")
def _cb(root):
    row = lambda i: {"premise": f"P{i}", "hypothesis": f"H{i}",  # noqa: E731
                     "label": ["entailment", "contradiction", "neutral"][i % 3], "idx": i}
    return superglue(root, "CB", repeat(row, 12), repeat(row, 4)), \
        lambda ex: ex.prompt.startswith("Suppose P") and ex.candidates == ("Yes", "No", "Maybe")


@preset("boolq")
def _boolq(root):
    row = lambda i: {"question": f"is it true number {i}", "passage": f"Passage {i}.", "idx": i, "label": bool(i % 2)}  # noqa: E731
    return superglue(root, "BoolQ", repeat(row, 10), repeat(row, 4)), \
        lambda ex: ex.prompt.startswith("Passage") and "Is it true number" in ex.prompt and ex.prompt.endswith("?\n")


@preset("wsc")
def _wsc(root):
    row = lambda i: {"text": f"Mark told Pete {i} lies. He was wrong.", "idx": i, "label": bool(i % 2),  # noqa: E731
                     "target": {"span1_index": 0, "span1_text": "Mark", "span2_index": 5, "span2_text": "He"}}
    return superglue(root, "WSC", repeat(row, 10), repeat(row, 4)), \
        lambda ex: 'does the pronoun "he" refer to Mark? Yes or No?\n' in ex.prompt and ex.candidates == ("No", "Yes")


@preset("wic")
def _wic(root):
    row = lambda i: {"word": "place", "sentence1": f"S1 {i}", "sentence2": f"S2 {i}", "idx": i, "label": bool(i % 2),  # noqa: E731
                     "start1": 0, "end1": 2, "start2": 0, "end2": 2}
    return superglue(root, "WiC", repeat(row, 10), repeat(row, 4)), \
        lambda ex: ex.prompt.startswith('Does the word "place" have the same meaning') and ex.prompt.endswith("\n")


@preset("multirc")
def _multirc(root):
    def row(i):
        answers = [{"text": f"answer {i}.{j}", "idx": j, "label": j % 2} for j in range(3)]
        return {"idx": i, "version": 1.1,
                "passage": {"text": f"<b>Sent 1: </b>Paragraph {i}.<br>",
                            "questions": [{"question": f"Q{i}?", "answers": answers, "idx": 0}]}}
    return superglue(root, "MultiRC", repeat(row, 4), repeat(row, 2)), \
        lambda ex: ex.prompt.endswith('". Is that correct? Yes or No?\n') and "Question: Q" in ex.prompt


@preset("copa")
def _copa(root):
    row = lambda i: {"premise": f"My body cast shadow {i}.", "choice1": "The sun was rising.",  # noqa: E731
                     "choice2": "I cut the grass.", "question": ["cause", "effect"][i % 2], "idx": i, "label": i % 2}
    return superglue(root, "COPA", repeat(row, 10), repeat(row, 4)), \
        lambda ex: (ex.prompt.startswith("My body cast shadow") and ex.prompt.endswith((" because", " so"))
                    and ex.candidates == (" the sun was rising.", " I cut the grass."))


@preset("record")
def _record(root):
    def row(i):
        text = f"Alice met Bob in Paris {i}.\n@highlight\nBob left"
        entities = [{"start": 0, "end": 4}, {"start": 10, "end": 12}, {"start": 17, "end": 21}]
        return {"source": "x", "idx": i, "passage": {"text": text, "entities": entities},
                "qas": [{"query": "@placeholder is a city", "idx": 0,
                         "answers": [{"start": 17, "end": 21, "text": "Paris"}]}]}
    return superglue(root, "ReCoRD", repeat(row, 10), repeat(row, 4)), \
        lambda ex: (ex.prompt.endswith("- Bob left\n-") and ex.candidates == (" Alice is a city", " Bob is a city",
                                                                               " Paris is a city") and ex.gold == (2,))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_reads_its_distributed_format(tokenizer, tmp_path, name):
    """MeZO's protocol: the unlabelled test file is dropped, the validation file becomes the test
    split and the validation split is drawn from train."""
    folder, looks_right = PRESETS[name](tmp_path)
    t = task(tokenizer, f"task={name}", f"task.path={folder}", "task.val_size=2")
    assert t.size("validation") == 2 and t.size("test") >= 2 and t.size("train") >= 2
    for ex in t.splits.train + t.splits.validation + t.splits.test:
        assert looks_right(ex), ex
    kind = "multiple_choice" if name in ("copa", "record") else "classification"
    assert t.kind == kind and t.teacher_forcing == (kind == "multiple_choice")
    t.batch("test", range(t.size("test")))  # encodes


def test_presets_read_datasets_exports_too(tokenizer, tmp_path):
    """The Hugging Face exports of super_glue name fields and encode labels their own way (integer
    labels; ReCoRD's entities and answers as strings, one record per query)."""
    import datasets

    rte = datasets.Dataset.from_list([{"premise": f"P{i}", "hypothesis": "H", "label": i % 2, "idx": i}
                                      for i in range(8)])
    datasets.DatasetDict({"train": rte, "validation": rte.select(range(4)),
                          "test": rte.map(lambda r: {"label": -1})}).save_to_disk(str(tmp_path / "rte"))
    t = task(tokenizer, "task=rte", f"task.path={tmp_path / 'rte'}", "task.val_size=2")
    assert [ex.label for ex in t.splits.test] and {ex.label for ex in t.splits.test} <= {0, 1}
    # the test split is the export's validation (rows 0-3); its label 0 is entailment, the class of "Yes"
    assert (sorted((ex.prompt.split("\n")[0], ex.label) for ex in t.splits.test)
            == [("P0", 0), ("P1", 1), ("P2", 0), ("P3", 1)])
    assert all(ex.label == int(ex.prompt[1]) % 2 for ex in t.splits.train + t.splits.validation)
    assert t.splits.test[0].candidates == ("Yes", "No")
    rec = datasets.Dataset.from_list([{"passage": "A and B.\n@highlight\nC", "query": "@placeholder wins",
                                       "idx": {"passage": i},
                                       "entities": ["A", "B", "A"], "entity_spans": {"start": [0, 6, 0]},
                                       "answers": ["B"]} for i in range(8)])
    rec.save_to_disk(str(tmp_path / "record"))
    t = task(tokenizer, "task=record", f"task.path={tmp_path / 'record'}", "task.val_size=2", "task.test_size=2")
    ex = t.splits.train[0]
    assert ex.candidates == (" A wins", " B wins") and ex.gold == (1,) and ex.prompt == "A and B.\n- C\n-"


# --- batches: candidates, teacher forcing, several right answers, demonstrations --------------------

def test_candidates_follow_one_shared_prompt(tokenizer, tmp_path):
    folder, _ = PRESETS["copa"](tmp_path)
    t = task(tokenizer, "task=copa", f"task.path={folder}", "task.val_size=2")
    batch = t.batch("train", [0, 1])
    seq = batch.sequences[0]
    prompt = t._prompts["train"][0]
    cands = t._candidates["train"][0]
    assert seq.tokens == tuple(prompt + cands[0] + cands[1])
    assert seq.branches == (len(prompt), len(prompt) + len(cands[0]))
    assert seq.targets == tuple(cands[0] + cands[1]) and batch.unit_example == [0, 0, 1, 1]
    assert seq.scored[0] == seq.scored[len(cands[0])] == len(prompt) - 1  # both candidates' first tokens
    tf = t.train_batch([0, 1])  # teacher forcing: the right candidate only, its tokens the targets
    gold = cands[t.splits.train[0].label]
    assert tf.readout == "tokens" and tf.sequences[0].tokens == tuple(prompt + gold)
    assert tf.sequences[0].targets == tuple(gold)
    scored = task(tokenizer, "task=copa", f"task.path={folder}", "task.val_size=2", objective="accuracy")
    assert scored.train_batch([0]).readout == "likelihoods"


def test_an_example_with_several_right_answers_counts_any_of_them():
    from distzo.data.batches import Batch, Scores, TokenSequence
    from distzo.data.objectives import accuracy_counts

    batch = Batch([TokenSequence((1,)), TokenSequence((2,))], [0, 1], [0, 0, 0, 1, 1], torch.tensor([0, 1]),
                  readout="likelihoods", extra={"gold": [(0, 2), (1,)]})
    scores = Scores(torch.tensor([3.0, 2.0, 1.0, 5.0, 1.0], dtype=torch.float64), torch.ones(5, dtype=torch.float64))
    assert accuracy_counts(scores, batch) == (2, 2)  # example 0 picks candidate 2, also right


def test_demonstrations_come_from_train_and_precede_every_prompt(tokenizer, tmp_path):
    path = reviews_in("jsonl", tmp_path)
    plain = task(tokenizer, *THREE_CLASS, f"task.path={path}", *SMALL)
    icl = task(tokenizer, *THREE_CLASS, f"task.path={path}", *SMALL, "task.demos=2")
    assert icl.size("train") == plain.size("train") - 2 and icl.splits.test == plain.splits.test
    assert icl.demos.count(" Overall it was") == 2 and icl.demos.endswith("\n\n")
    assert tokenizer(icl.demos + plain.splits.test[0].prompt).input_ids[-5:] == icl._prompts["test"][0][-5:]
    assert len(icl._prompts["test"][0]) > len(plain._prompts["test"][0])


# --- errors: one line naming the file, the record and the fix ---------------------------------------

def test_errors_name_the_file_the_record_and_the_fix(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl",
                       [{"text": f"t{i}", "label": "positive" if i % 2 else "negative"} for i in range(12)]
                       + [{"text": "odd", "label": "mixed"}])
    with pytest.raises(DataError, match=r"record 12 of the all split of .*d.jsonl has label 'mixed', "
                                        r"which is not in task.labels"):
        task(tokenizer, "task=custom", f"task.path={path}", "task.labels=[negative,positive]",
             "task.label_words=[' bad',' good']", *SMALL)
    with pytest.raises(DataError, match=r"has label 'negative', not a class index; set task.labels"):
        task(tokenizer, "task=custom", f"task.path={path}", "task.label_words=[' bad',' good']", *SMALL)
    floats = write_jsonl(tmp_path / "f.jsonl", [{"text": f"t{i}", "label": i % 2} for i in range(12)]
                         + [{"text": "odd", "label": 1.5}])  # arrow reads the whole column as floats
    with pytest.raises(DataError, match=r"record 12 of the all split of .*f.jsonl has label 1.5, not a class index"):
        task(tokenizer, "task=custom", f"task.path={floats}", "task.label_words=[' bad',' good']", *SMALL)
    for labels in ("[0,1]", "[0.0,1.0]"):  # the other records' 0.0 and 1.0 are labels 0 and 1, written either way
        with pytest.raises(DataError, match=r"record 12 of the all split of .*f.jsonl has label 1.5, which is not in "
                                            r"task.labels"):
            task(tokenizer, "task=custom", f"task.path={floats}", f"task.labels={labels}",
                 "task.label_words=[' bad',' good']", *SMALL)
    whole = write_jsonl(tmp_path / "w.jsonl", [{"text": f"t{i}", "label": float(i % 2)} for i in range(12)])
    for labels in ("[0,1]", "[0.0,1.0]", "[1,0]"):
        read = task(tokenizer, "task=custom", f"task.path={whole}", f"task.labels={labels}",
                    "task.label_words=[' bad',' good']", *SMALL)
        flip = labels == "[1,0]"
        assert all(ex.label == int(ex.prompt[1:]) % 2 ^ flip for split in ("train", "validation", "test")
                   for ex in getattr(read.splits, split))
    with pytest.raises(DataError, match=r"task.template='\{review\}' reads the field 'review', "
                                        r"but record 0 .* has only \['label', 'text'\]"):
        task(tokenizer, "task=custom", f"task.path={path}", "task.template='{review}'",
             "task.labels=[negative,positive]", "task.label_words=[' bad',' good']", *SMALL)
    mc = write_jsonl(tmp_path / "mc.jsonl",
                     [{"q": "x", "options": ["a", "b"], "answer": 0}] * 8 + [{"q": "y", "answer": 1}])
    with pytest.raises(DataError, match=r"record 8 .* has no list of candidates in field 'options'"):
        task(tokenizer, "task=custom", f"task.path={mc}", "task.kind=multiple_choice", "task.template='{q}'",
             "task.candidates_field=options", "task.label_field=answer", *SMALL)
    with pytest.raises(ConfigError, match=r"task.path='/no/such.csv' does not exist"):
        make_config("task=custom", "task.path=/no/such.csv")
    with pytest.raises(ConfigError, match=r"task=custom needs data: add task.path=org/name \(a hub dataset\) or "):
        make_config("task=custom")
    assert make_config("task=rte").task.path == "aps/super_glue"  # the preset's public hub dataset
    empty = tmp_path / "empty"
    write_jsonl(empty / "train.jsonl", [{"text": "a", "label": 0}] * 4)
    (empty / "val.jsonl").write_text("")
    with pytest.raises(DataError, match=r"the test split of .*empty is empty; give it examples"):
        task(tokenizer, "task=custom", f"task.path={empty}", "task.val_size=1")


def test_unreadable_files_say_why_in_distzos_line_alone(tmp_path, caplog, capfd):
    """A file that is not UTF-8 says so (arrow decodes a JSON file's strings only when the records are
    listed, after datasets has read it); a file datasets cannot parse gives the parser's own reason
    (the row), not datasets' wrapper, and datasets' own log line about it is not printed too."""
    from distzo.data.records import read_records

    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes("".join(f'{{"text": "caf\u00e9 {i}", "label": 0}}\n' for i in range(4)).encode("latin-1"))
    with pytest.raises(DataError, match=r"cannot read .*latin1.jsonl: it is not UTF-8 \(byte 0xe9 does not decode\); "
                                        r"re-save it as UTF-8$"):
        read_records(latin1)
    cut = tmp_path / "cut.jsonl"
    cut.write_text('{"text": "a", "label": 0}\n{"text": "b')
    with pytest.raises(DataError, match=r"cannot read .*cut.jsonl as json: JSON parse error: Missing a closing "
                                        r"quotation mark in string\. in row 1; check the file"):
        read_records(cut)
    quote = tmp_path / "quote.csv"
    quote.write_text('text,label\n"never closed,1\n')
    with pytest.raises(DataError, match=r"cannot read .*quote.csv as csv: Error tokenizing data\. C error: EOF inside "
                                        r"string starting at row 1; check the file"):
        read_records(quote)
    printed = caplog.text + "".join(capfd.readouterr())
    assert "Failed to load JSON" not in printed and "cut.jsonl" not in printed


def test_prompts_are_encoded_when_first_read_as_they_were_up_front(tokenizer):
    """9,103 movie reviews to train on: building the task encodes only the label words; a batch encodes its own
    examples, once, into the ids the tokenizer gives the prompt (ending on its own last token)."""
    calls = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, text, **kw):
            calls.append(text)
            return self.inner(text, **kw)

    t = task(Counting(tokenizer), "task=mr-polarity")
    assert t.size("train") == 9103 and len(calls) <= 2  # the label words, when not one shared token each
    before = len(calls)
    batch = t.batch("validation", [3, 7])
    again = t.batch("validation", [3, 7])
    assert len(calls) == before + 2 and batch.sequences == again.sequences
    for i, seq in zip([3, 7], batch.sequences):
        ids = tokenizer(t.splits.validation[i].prompt).input_ids
        assert list(seq.tokens) == ids == t._prompts["validation"][i]
    assert t._prompts["validation"][3:8:4] == [list(seq.tokens) for seq in batch.sequences]


def test_a_record_without_a_field_the_template_reads_is_refused(tokenizer, tmp_path):
    """Records share their file's columns, so a field one record lacks reads as None, as a null does:
    either would be trained on as the text "None"."""
    rows = [{"text": f"t{i}", "label": i % 2} for i in range(12)]
    for name, odd in [("missing", {"label": 1}), ("null", {"text": None, "label": 1})]:
        path = write_jsonl(tmp_path / f"{name}.jsonl", rows[:7] + [odd] + rows[7:])
        with pytest.raises(DataError, match=rf"record 7 of the all split of .*{name}.jsonl has no value for the field "
                                            r"'text' \(missing or null\), which task.template='\{text\} It was' reads; "
                                            r"give every record its 'text', or remove that record"):
            task(tokenizer, "task=custom", f"task.path={path}", "task.template='{text} It was'",
                 "task.label_words=[' bad',' good']", *SMALL)


def test_max_tokens_cuts_long_texts_to_one_length(tokenizer, tmp_path):
    """task=lm-2048's mechanism on a small scale: texts modelled whole are cut to task.max_tokens
    (the start token and the text's first max_tokens - 1 tokens); shorter ones are kept whole; prompt
    and completion layouts lose the completion's end, and a prompt with no room keeps its end."""
    words = "the film was long and the plot was thin but the actors were good " * 20
    rows = [{"text": words}, {"text": "a short one"}] * 6
    data = write_jsonl(tmp_path / "texts.jsonl", rows)
    t = task(tokenizer, "task=custom", f"task.path={data}", "task.kind=generation", "task.max_tokens=40", *SMALL)
    whole = [len(tokenizer(r["text"], add_special_tokens=False).input_ids) + 1 for r in rows[:2]]
    assert whole[0] > 40 > whole[1]
    lengths = {len(s.tokens) for s in t.train_batch(range(t.size("train"))).sequences}
    assert lengths == {40, whole[1]}
    long = next(s for s in t.train_batch(range(t.size("train"))).sequences if len(s.tokens) == 40)
    full = [t.encode("")[0]] + tokenizer(words, add_special_tokens=False).input_ids
    assert list(long.tokens) == full[:40] and len(long.targets) == 39  # the text's start, every token scored
    assert t.longest_sequence() == 40

    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "one two three four five six", "completion": words}] * 12)
    t = task(tokenizer, "task=custom", f"task.path={pairs}", "task.kind=generation", "task.max_tokens=4", *SMALL)
    prompt = t.encode("one two three four five six")
    completion = tokenizer(words + "\n", add_special_tokens=False).input_ids
    assert len(prompt) > 3
    s = t.train_batch([0]).sequences[0]
    assert list(s.tokens) == prompt[-3:] + completion[:1]
    assert len(s.targets) == 1  # one completion token left


def test_texts_modelled_whole_need_a_start_token_and_are_refused_up_front_without_one(tokenizer, tmp_path):
    """A text modelled whole has an empty prompt, which the tokenizer's BOS (else EOS) stands for;
    a tokenizer with neither is refused as the task is built, not when a step first reads such an
    example (prompts are encoded when first read)."""
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.bos_token = bare.eos_token = None
    assert bare.bos_token_id is None and bare.eos_token_id is None and bare.pad_token_id is not None
    data = write_jsonl(tmp_path / "texts.jsonl", [{"text": f"text number {i}"} for i in range(12)])
    overrides = ("task=custom", f"task.path={data}", "task.kind=generation", *SMALL)
    assert task(tokenizer, *overrides).encode("") in ([tokenizer.bos_token_id], [tokenizer.eos_token_id])
    with pytest.raises(DataError, match="a record has no prompt, and this tokenizer has no beginning- or "
                                        "end-of-sequence token to start it with; give the records a prompt"):
        task(bare, *overrides)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"q{i}", "completion": "a"} for i in range(12)])
    assert task(bare, "task=custom", f"task.path={pairs}", "task.kind=generation", *SMALL).size("train") == 7


def test_max_tokens_and_text_sets_refuse_other_kinds(tokenizer):
    with pytest.raises(ConfigError, match="task.max_tokens caps a generation task"):
        make_config("model=tiny", "task=synthetic-cue", "task.max_tokens=64")
    with pytest.raises(ConfigError, match="review-documents set holds texts to model whole"):
        make_config("model=tiny", "task=lm-2048", "task.kind=classification")
    with pytest.raises(ConfigError, match=r"task.max_tokens.*>= 2"):
        make_config("model=tiny", "task=lm-2048", "task.max_tokens=1")


def test_a_trainers_datasets_say_their_longest_sequence():
    """ZOTrainer's task (TrainerDataTask) measures what the position check needs: the longest
    tokenized row over its splits, read from Arrow for a datasets.Dataset with its selection
    respected (a selected subset of short rows is not measured by the table's longest row), row by
    row for a plain list, and 0 for rows the collator has yet to tokenize."""
    from datasets import Dataset

    from distzo.hf.data import TrainerDataTask

    data = Dataset.from_dict({"input_ids": [[1] * 9, [1] * 3, [1] * 5]})
    collate = lambda rows: rows  # noqa: E731 (unused here)
    assert TrainerDataTask(data, None, collate, 0).longest_sequence() == 9
    assert TrainerDataTask(data.select([1, 2]), data.select([1]), collate, 0).longest_sequence() == 5
    assert TrainerDataTask([{"input_ids": [1, 2]}, {"input_ids": [1] * 7}], None, collate, 0).longest_sequence() == 7
    assert TrainerDataTask(Dataset.from_dict({"text": ["a b c"]}), None, collate, 0).longest_sequence() == 0
