"""The bundled data sets, deterministic splits, prompt encoding, packing and the batch sampler."""

import hashlib
import json

import torch

from distzo.data.batches import Batch, TokenSequence, label_word_batch
from distzo.data.bundled import movie_review_endings, movie_reviews
from distzo.data.tasks import PromptTask, TrainSampler
from tests.conftest import make_config


def test_movie_reviews_are_the_full_polarity_set():
    records = movie_reviews()
    assert len(records) == 10603  # 10,605 lines, two sentences duplicated (both negative)
    assert len({r["sentence"] for r in records}) == 10603
    assert sum(r["label"] for r in records) == 5331
    assert records[0]["sentence"].startswith("The Rock is destined") and records[0]["label"] == 1
    assert records[-1]["label"] == 0 and all(r["sentence"] for r in records)


def test_movie_review_endings_are_four_way_multiple_choice():
    records = movie_review_endings()
    assert len(records) == 9581 and records == movie_review_endings()  # the same draw each call
    # and the same draw across versions: a changed draw would silently change the task's data
    assert records[0] == {"context": "The Rock is destined to be the 21st Century's new ''Conan'' and that he's "
                                     "going to make a splash even greater than Arnold Schwarzenegger, Jean Claud "
                                     "Van Damme",
                          "endings": ["stoke the conversation.", "is more original.", "or Steven Segal.",
                                      "great cinematic innovation."], "label": 2}
    assert records[-1]["endings"] == ["the reality check.", "torture seem appealing.", "this case zero.",
                                      "of Tim Allen."]
    digest = hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()
    assert digest == "1cd296b2242d3a790e8c5695c356f7d76e1ead5f7532d50587d0a3a320bd8a70"
    reviews = {" ".join(r["sentence"].split()) for r in movie_reviews()}  # words joined by single spaces
    for r in records[:500]:
        assert len(r["endings"]) == len(set(r["endings"])) == 4
        assert f"{r['context']} {r['endings'][r['label']]}" in reviews  # the right ending completes the review
    assert sorted({r["label"] for r in records}) == [0, 1, 2, 3]


def test_splits_are_deterministic_and_disjoint(tokenizer):
    a, b = (PromptTask(make_config().task, tokenizer).splits for _ in range(2))
    c = PromptTask(make_config("task.split_seed=1").task, tokenizer).splits
    assert (len(a.train), len(a.validation), len(a.test)) == (9103, 500, 1000)
    assert a == b and a.validation != c.validation
    texts = [{e.prompt for e in s} for s in (a.train, a.validation, a.test)]
    assert not (texts[0] & texts[1]) and not (texts[0] & texts[2]) and not (texts[1] & texts[2])
    assert 0.4 < sum(e.label for e in a.validation) / 500 < 0.6


def test_prompt_and_label_words(tokenizer):
    task = PromptTask(make_config().task, tokenizer)
    assert task.label_ids.tolist() == [tokenizer(" terrible", add_special_tokens=False).input_ids[0],
                                       tokenizer(" great", add_special_tokens=False).input_ids[0]]
    ids = task.encode("A fine film. It was")
    assert tokenizer.decode(ids) == "A fine film. It was"
    assert task.splits.train[0].prompt.endswith(" It was")
    assert task.splits.train[0].candidates == (" terrible", " great")


def test_packing_keeps_every_prompt_and_restarts_positions():
    seqs = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    batch = label_word_batch(seqs, torch.tensor([0, 1, 0, 1]), torch.tensor([3, 4]), pad_id=0)
    one = batch.pack(1024)
    assert one.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    assert one.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 0, 1, 2, 3]]
    assert one.score_col.tolist() == [2, 3, 5, 9] and one.score_row.tolist() == [0, 0, 0, 0]
    assert one.real.all() and one.segment is None  # no branches: position ids alone separate prompts
    rows = batch.pack(4)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0], [11, 12, 13, 14]]
    assert rows.position_ids[1].tolist() == [0, 1, 0, 1]  # the pad tail is a segment of its own
    assert rows.real[1].tolist() == [True, True, False, False]
    assert rows.input_ids[rows.score_row, rows.score_col].tolist() == [7, 8, 10, 14]


def test_branches_continue_the_prefix_positions_and_see_only_it():
    """A shared prompt [1, 2, 3] with two candidates [4, 5] and [6]: positions continue from 3 in each
    branch, and the mask lets a branch see the prefix and itself, never the other branch."""
    seq = TokenSequence((1, 2, 3, 4, 5, 6), branches=(3, 5), scored=(2, 3, 2), targets=(4, 5, 6), units=(0, 0, 1))
    batch = Batch([seq, TokenSequence((7, 8), scored=(1,), targets=(9,), units=(2,))], [0, 1], [0, 0, 1],
                  torch.tensor([0, 0]), readout="likelihoods")
    packed = batch.pack(1024)
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1]]
    assert packed.branch.tolist() == [[0, 0, 0, 1, 1, 2, 0, 0]] and packed.segment.tolist() == [[0] * 6 + [1] * 2]
    visible = packed.mask_fn()
    q, kv = torch.arange(8)[:, None], torch.arange(8)[None, :]
    allowed = visible(torch.zeros(8, 8, dtype=torch.long), None, q, kv) & (kv <= q)
    assert allowed[5].tolist() == [True, True, True, False, False, True, False, False]  # candidate 2: prompt, itself
    assert allowed[4].tolist() == [True] * 5 + [False] * 3  # candidate 1: prompt and its own first token
    assert allowed[7].tolist() == [False] * 6 + [True, True]  # the next sequence sees only itself
    assert packed.score_col.tolist() == [2, 3, 2, 7] and packed.score_unit.tolist() == [0, 0, 1, 2]


def test_shards_partition_the_batch():
    batch = label_word_batch([[i + 1] for i in range(10)], torch.arange(10), torch.tensor([3, 4]))
    shards = [batch.shard(i, 4) for i in range(4)]
    assert [s.size for s in shards] == [3, 3, 2, 2]
    assert [x.tokens for s in shards for x in s.sequences] == [x.tokens for x in batch.sequences]
    assert all(s.units == s.size and [x.units for x in s.sequences] == [(u,) for u in range(s.size)] for s in shards)


def test_shards_keep_every_unit_of_an_example():
    """An example with several units (candidates) goes to one shard whole; units are renumbered."""
    seqs = [TokenSequence((1, 2, 3, 4), branches=(2, 3), scored=(1, 2), targets=(3, 4), units=(0, 1)),
            TokenSequence((5, 6, 7), branches=(2,), scored=(1,), targets=(7,), units=(2,)),
            TokenSequence((8, 9, 1, 2), branches=(2, 3), scored=(1, 2), targets=(1, 2), units=(3, 4))]
    batch = Batch(seqs, [0, 1, 2], [0, 0, 1, 2, 2], torch.tensor([1, 0, 0]), readout="likelihoods")
    second = batch.shard(1, 2)
    assert second.size == 1 and second.units_per_example() == [2] and second.sequences[0].units == (0, 1)
    assert batch.shard(0, 2).units_per_example() == [2, 1]


def test_sampler_is_a_pure_function_of_seed_and_step():
    a, b = TrainSampler(50, 16, seed=3), TrainSampler(50, 16, seed=3)
    steps = [a.indices(t) for t in range(8)]
    assert steps == [b.indices(t) for t in reversed(range(8))][::-1]  # any order of requests
    first_epoch = sum(steps[:3], []) + steps[3][:2]
    assert sorted(first_epoch) == list(range(50))  # each example once per epoch
    assert TrainSampler(50, 16, seed=4).indices(0) != steps[0]
