"""The bundled data set, deterministic splits, prompt encoding, packing and the batch sampler."""

import torch

from distzo.data.datasets import load_splits, movie_reviews
from distzo.data.tasks import Batch, ClassificationTask, TrainSampler
from tests.conftest import make_config


def test_movie_reviews_are_the_full_polarity_set():
    examples = movie_reviews()
    assert len(examples) == 10603  # 10,605 lines, two sentences duplicated (both negative)
    assert len({e.text for e in examples}) == 10603
    assert sum(e.label for e in examples) == 5331
    assert examples[0].text.startswith("The Rock is destined") and examples[0].label == 1
    assert examples[-1].label == 0 and all(e.text for e in examples)


def test_splits_are_deterministic_and_disjoint():
    a = load_splits("mr-polarity", 500, 1000, None, 0)
    b = load_splits("mr-polarity", 500, 1000, None, 0)
    c = load_splits("mr-polarity", 500, 1000, None, 1)
    assert (len(a.train), len(a.validation), len(a.test)) == (9103, 500, 1000)
    assert a == b and a.validation != c.validation
    texts = [set(e.text for e in s) for s in (a.train, a.validation, a.test)]
    assert not (texts[0] & texts[1]) and not (texts[0] & texts[2]) and not (texts[1] & texts[2])
    assert 0.4 < sum(e.label for e in a.validation) / 500 < 0.6


def test_prompt_and_label_words(tokenizer):
    task = ClassificationTask(make_config().task, tokenizer)
    assert task.label_ids.tolist() == [tokenizer(" terrible", add_special_tokens=False).input_ids[0],
                                       tokenizer(" great", add_special_tokens=False).input_ids[0]]
    ids = task.encode("A fine film.")
    assert tokenizer.decode(ids) == "A fine film. It was"


def test_label_words_must_differ_in_their_first_token(tokenizer):
    import pytest

    from distzo.config import ConfigError

    cfg = make_config("task.label_words=[' great',' great']")
    with pytest.raises(ConfigError, match="share a first token"):
        ClassificationTask(cfg.task, tokenizer)


def test_packing_keeps_every_prompt_and_restarts_positions():
    seqs = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]
    batch = Batch(seqs, torch.tensor([0, 1, 0, 1]), pad_id=0)
    one = batch.pack(1024)
    assert one.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    assert one.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 0, 1, 2, 3]]
    assert one.last_col.tolist() == [2, 3, 5, 9] and one.last_row.tolist() == [0, 0, 0, 0]
    rows = batch.pack(4)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0], [11, 12, 13, 14]]
    assert rows.position_ids[1].tolist() == [0, 1, 0, 1]  # the pad tail is a segment of its own
    assert rows.input_ids[rows.last_row, rows.last_col].tolist() == [7, 8, 10, 14]


def test_shards_partition_the_batch():
    batch = Batch([[i] for i in range(10)], torch.arange(10))
    shards = [batch.shard(i, 4) for i in range(4)]
    assert [s.size for s in shards] == [3, 3, 2, 2]
    assert sum((s.sequences for s in shards), []) == batch.sequences


def test_sampler_is_a_pure_function_of_seed_and_step():
    a, b = TrainSampler(50, 16, seed=3), TrainSampler(50, 16, seed=3)
    steps = [a.indices(t) for t in range(8)]
    assert steps == [b.indices(t) for t in reversed(range(8))][::-1]  # any order of requests
    first_epoch = sum(steps[:3], []) + steps[3][:2]
    assert sorted(first_epoch) == list(range(50))  # each example once per epoch
    assert TrainSampler(50, 16, seed=4).indices(0) != steps[0]
