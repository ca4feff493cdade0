"""Train / validation / test: a deterministic function of the data and `task.split_seed` only.

Never of the run seed or the mesh, so every run and every rank sees the same partition.

- **One pool** (a bundled set, a single file, a one-split export): shuffled with `split_seed`; the
  first `test_size` examples are the test split, the next `val_size` the validation split, the rest
  (at most `train_size`) the training split.
- **Sizes left unset** (`null`, as `task=custom` leaves them): a drawn split takes 500 (validation)
  or 1,000 (test) examples, or a tenth of what it is drawn from when that is fewer (at least one),
  so a small file trains without settings (300 rows: 30 / 30 / 240); a split of the data's own is
  cut to at most 500 (validation) or 1,000 (test) examples.
- **Splits of its own** (a folder of split files, a `DatasetDict`): each is kept. Public copies of
  GLUE and SuperGLUE have no answers in their test files, so a test split without labels is
  dropped; then, as MeZO does, the file's validation split becomes the test split and a validation
  split of `val_size` examples is drawn from the training split. A missing validation split is drawn
  from the training split too. Each split is shuffled with `split_seed` and cut to its size
  (`train_size`, `val_size`, `test_size`; MeZO's 1000 / 500 / 1000 in the SuperGLUE presets).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Sequence

from .examples import Example
from .records import DataError

log = logging.getLogger("distzo")


@dataclass
class Splits:
    train: list[Example]
    validation: list[Example]
    test: list[Example]


def _shuffled(items: Sequence[Example], seed: int) -> list[Example]:
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in order]


def _cap(items: list[Example], size: int | None) -> list[Example]:
    return items if size is None else items[:size]


AUTO_VAL_SIZE, AUTO_TEST_SIZE = 500, 1000  # unset sizes: at most these, and at most a tenth of the data


def drawn_size(size: int | None, cap: int, available: int) -> int:
    """A split's size: as configured, or (unset) `cap` or a tenth of the `available` examples it is
    drawn from, whichever is fewer, and at least one."""
    return size if size is not None else max(1, min(cap, available // 10))


def split_pool(pool: Sequence[Example], val_size: int | None, test_size: int | None, train_size: int | None,
               seed: int, origin: str) -> Splits:
    if not pool:  # an empty file or subset: say so, not that the split sizes leave nothing
        raise DataError(f"{origin} holds no records; fill it, or point task.path (or task.subset) at the data")
    val_size = drawn_size(val_size, AUTO_VAL_SIZE, len(pool))
    test_size = drawn_size(test_size, AUTO_TEST_SIZE, len(pool))
    if val_size + test_size >= len(pool):
        raise DataError(f"task.val_size + task.test_size = {val_size + test_size} leaves no training data "
                        f"({origin} has {len(pool)} examples)")
    shuffled = _shuffled(pool, seed)
    test = shuffled[:test_size]
    validation = shuffled[test_size:test_size + val_size]
    return Splits(_cap(shuffled[test_size + val_size:], train_size), validation, test)


def make_splits(parts: dict[str, list[Example] | None], val_size: int | None, test_size: int | None,
                train_size: int | None, seed: int, origin: str) -> Splits:
    """parts: examples by split name ("all" for one pool); None marks a split without labels."""
    if "all" in parts:
        pool = parts["all"]
        if pool is None:
            raise DataError(f"no record of {origin} has an answer; point task.label_field (classification, multiple "
                            "choice) or task.answers_field (generation) at the field that holds it, or give generation "
                            "records prompt and completion fields, a messages list or a text field")
        return split_pool(pool, val_size, test_size, train_size, seed, origin)
    train = parts.get("train")
    if not train:
        raise DataError(f"{origin} has no labelled training split (train.*); name the training file train.jsonl, "
                        "train.csv, ... or point task.path at a single file to split")
    validation, test = parts.get("validation"), parts.get("test")
    if validation is None and test is None:  # a training split alone: split it as one pool
        return split_pool(train, val_size, test_size, train_size, seed, origin)
    if "test" in parts and test is None:
        log.info("%s: the test split has no labels; it is not used", origin)
    if test is None and validation is not None:
        log.info("%s: its validation split is the test split, and a validation split is drawn from train "
                 "(MeZO's protocol)", origin)
        test, validation = validation, None
    train = _shuffled(train, seed)
    if validation is None:
        val_size = drawn_size(val_size, AUTO_VAL_SIZE, len(train))
        if val_size >= len(train):
            raise DataError(f"task.val_size={val_size} leaves no training data ({origin}'s training split has "
                            f"{len(train)} examples); lower task.val_size")
        validation, train = train[:val_size], train[val_size:]
    else:
        validation = _cap(_shuffled(validation, seed + 1), AUTO_VAL_SIZE if val_size is None else val_size)
    test = _cap(_shuffled(test, seed + 2), AUTO_TEST_SIZE if test_size is None else test_size)
    return Splits(_cap(train, train_size), validation, test)
