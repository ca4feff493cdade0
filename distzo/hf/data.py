"""A transformers Trainer's data as a distzo task: tokenized examples with `labels` (-100 masked),
collated by the Trainer's data collator, become batches of the scoring contract
(`distzo.data.batches`), so distzo's engine trains on exactly what transformers' causal-LM loss reads.

Example i of a collated batch is the sequence of its real tokens (where `attention_mask` is 1; all
of them without one); every position t whose next label is not -100 is scored with target
labels[t + 1], one unit per example, readout `tokens`. A batch whose loss under transformers would
differ (no labels, labels that score padding, rows packed with restarting position_ids) is refused.
The loss over a (global) batch is then the summed token NLL over its count, transformers' token
mean: the shift and the -100 mask of `LlamaForCausalLM(labels=...)`, computed without padding."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ..data.batches import Batch, Scores
from ..data.batches import TokenSequence as Seq
from ..data.objectives import objective_sums
from ..errors import DistzoError

IGNORE = -100  # transformers' label for a token that is not scored

SPLITS = ("train", "validation", "test")


class TrainerDataError(DistzoError):
    """A Trainer's dataset or collated batch that distzo cannot score as transformers' causal-LM loss
    does; the message says what to change."""


class TrainerDataTask:
    """The task interface the training driver uses (`size`, `train_batch`, `batches`,
    `objective_sums`, `describe`) over a Trainer's datasets and collator. `kind` is generation and
    nothing is decoded: evaluation by distzo reports the token loss and perplexity (a Trainer's
    evaluation runs its own loop and `compute_metrics`)."""

    kind = "generation"
    decodes = False
    scores_candidates = False  # evaluation reports the token loss (and perplexity)
    name = "trainer data"

    def __init__(self, train_dataset: Any, eval_dataset: Any, collator: Callable[[list], dict], pad_id: int,
                 describe_as: str = "the Trainer's train_dataset"):
        if not (hasattr(train_dataset, "__len__") and hasattr(train_dataset, "__getitem__")):
            raise TrainerDataError(f"{describe_as} is a {type(train_dataset).__name__} without len() or indexing (a "
                                   "streaming dataset): distzo's sampler draws each step's examples by index, from a "
                                   "shuffled order per epoch that a mesh and a resume repeat; materialise it first "
                                   "(datasets.Dataset.from_generator, or list(dataset.take(n)))")
        held_out = eval_dataset if eval_dataset is not None else []
        self.datasets = {"train": train_dataset, "validation": held_out, "test": held_out}
        self.collator, self.pad_id, self.origin = collator, pad_id, describe_as
        self.label_ids = None

    def size(self, split: str) -> int:
        return len(self.datasets[split])

    def batch(self, split: str, indices: Sequence[int]) -> Batch:
        """Examples `indices` of a split, collated as the Trainer collates them, as one Batch."""
        data = self.datasets[split]
        rows = [data[int(i)] for i in indices]
        collated = self.collator(rows)
        ids, labels, mask = _checked(collated)
        sequences = []
        for e in range(ids.shape[0]):
            real = mask[e].nonzero().view(-1)
            tokens = ids[e, real].tolist()
            targets_at = labels[e, real].tolist()
            scored = [t for t in range(len(tokens) - 1) if targets_at[t + 1] != IGNORE]
            sequences.append(Seq(tuple(tokens), (), tuple(scored), tuple(targets_at[t + 1] for t in scored),
                                 (e,) * len(scored)))
        n = len(rows)
        return Batch(sequences, list(range(n)), list(range(n)), torch.zeros(n, dtype=torch.long), None, self.pad_id,
                     "tokens")

    def train_batch(self, indices: Sequence[int]) -> Batch:
        return self.batch("train", indices)

    def longest_sequence(self) -> int:
        """The most tokens one forward pass reads: the longest tokenized `input_ids` of the datasets
        (0 when the rows are not tokenized yet: the collator's own truncation then decides)."""
        return max((_longest_input_ids(data) for data in self.datasets.values()), default=0)

    def batches(self, split: str, batch_size: int) -> Iterator[Batch]:
        n = self.size(split)
        for lo in range(0, n, batch_size):
            yield self.batch(split, range(lo, min(lo + batch_size, n)))

    def objective_sums(self, scores: Scores, batch: Batch, objective: str) -> torch.Tensor:
        return objective_sums(scores, batch, objective)

    def describe(self) -> str:
        return (f"Task: {self.size('train')} tokenized training examples from {self.origin}, trained on the token "
                "loss of their labels (transformers' causal-LM loss)")


def _longest_input_ids(data: Any) -> int:
    """The longest `input_ids` row of a dataset: read from Arrow without materialising the rows
    for a `datasets.Dataset` (its selection and shuffling respected), else row by row."""
    if hasattr(data, "with_format") and "input_ids" in (getattr(data, "column_names", None) or ()):
        import pyarrow.compute as pc
        column = data.with_format("arrow")["input_ids"]
        return int(pc.max(pc.list_value_length(column)).as_py() or 0) if len(column) else 0
    longest = 0
    for row in data:
        ids = row.get("input_ids") if isinstance(row, Mapping) else None
        if ids is not None:
            longest = max(longest, len(ids))
    return longest


def _checked(collated: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, labels and attention_mask of a collated batch, where distzo scores exactly the loss
    transformers' causal-LM head computes on it (the shifted labels, -100 left out); otherwise one
    error naming what differs."""
    if "input_ids" not in collated:
        raise TrainerDataError(f"the collated batch has no input_ids (it has {sorted(collated)}): ZOTrainer trains "
                               "a causal LM on tokenized examples; tokenize the dataset (Dataset.map with the "
                               "tokenizer) or use a collator that does")
    ids = _tensor(collated, "input_ids")
    if "labels" not in collated:
        raise TrainerDataError("the collated batch has no labels, so Trainer's model would return no loss to train or "
                               "evaluate; use a collator that makes them, such as "
                               "DataCollatorForLanguageModeling(tokenizer, mlm=False), or add a labels column")
    labels, mask = _tensor(collated, "labels"), _mask(collated, ids)
    if ids.dim() != 2 or labels.shape != ids.shape:
        raise TrainerDataError(f"labels of shape {list(labels.shape)} for input_ids of shape {list(ids.shape)}: "
                               "ZOTrainer trains a causal LM on the labels of each token (a classification or "
                               "sequence-to-sequence dataset has others); give AutoModelForCausalLM's data, labels "
                               "the shape of input_ids")
    if bool((labels[mask == 0] != IGNORE).any()):
        raise TrainerDataError("labels at padded positions (attention_mask 0) are not -100: Trainer's loss would score "
                               "the padding, and distzo scores the real tokens alone; set labels to -100 where "
                               "attention_mask is 0 (DataCollatorForLanguageModeling does), or pad nothing")
    positions = collated.get("position_ids")
    if positions is not None:
        expected = (mask.cumsum(-1) - 1).clamp(min=0)  # positions of the real tokens, as one sequence per row
        if not torch.equal(_tensor(collated, "position_ids")[mask == 1], expected[mask == 1]):
            raise TrainerDataError("the collator's position_ids do not count each row's real tokens from 0 (rows "
                                   "packed with DataCollatorWithFlattening restart them per example, which only "
                                   "padding-free attention keeps apart; or positions that count the padding), and "
                                   "distzo scores a row's real tokens as one sequence from position 0; use a padding "
                                   "collator such as DataCollatorForLanguageModeling(tokenizer, mlm=False)")
    return ids, labels, mask


def _tensor(collated: dict, key: str) -> torch.Tensor:
    value = collated[key]
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def _mask(collated: dict, ids: torch.Tensor) -> torch.Tensor:
    mask = collated.get("attention_mask")
    return torch.ones_like(ids) if mask is None else _tensor(collated, "attention_mask")
