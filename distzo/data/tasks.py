"""Prompted tasks: examples encoded into the batches of the scoring contract (`distzo.data.batches`).

A task reads its records (bundled, or local files through `datasets`), turns them into `Example`s
(a prompt, candidate continuations, the right ones: `distzo.data.examples`), splits them
(`distzo.data.splits`) and encodes each prompt once, when it is first read (`EncodedPrompts`). It
then hands the engine two kinds of batch:

- **scoring batches** (`batch`, `batches`): every candidate of every example, scored by its mean
  token log-likelihood after the prompt, as MeZO scores options; prediction is the best candidate.
  When every candidate is a single token shared by all examples (label words such as " terrible" /
  " great"), the head reads just their logits at the prompt's last token (MeZO's classification
  head; the same ranking and the same cross-entropy, the log-softmax normaliser cancelling). Otherwise
  the candidates follow the prompt as branches of one sequence, so the prompt is computed once per
  example, not once per candidate.
- **training batches** (`train_batch`): the step's loss. `task.loss=classification` is the
  cross-entropy over the candidates' scores (MeZO's classification tasks); `teacher_forcing` is the
  token loss of the right candidate alone, prompt excluded (MeZO's multiple-choice tasks). The
  accuracy objective needs every candidate, so it always trains on scoring batches.

`task.demos=K` puts K solved training examples before every prompt (in-context learning, MeZO's
ICL baseline): a fixed draw (`split_seed`) shared by every example and every rank.
"""

from __future__ import annotations

import logging
import random
from typing import Callable, Iterator, Sequence, overload

import torch

from .. import hub
from ..config.schema import TaskConfig
from .answers import exact_match, f1_score
from .batches import Batch, Scores, label_word_batch
from .batches import TokenSequence as Seq
from .bundled import BUNDLED, bundled_records
from .decoding import answer_text
from .examples import RecordFormatter
from .kinds import kind_type
from .objectives import objective_sums
from .readers import JSON_OBJECTS, READERS
from .records import DataError, hub_records, read_records, split_names
from .splits import Splits, make_splits
from .trivia import trivia_records

SPLITS = ("train", "validation", "test")

log = logging.getLogger("distzo")


def load_examples(cfg: TaskConfig, chat=None, pin: hub.Pin | None = None) -> tuple[Splits, str]:
    """The task's splits of examples, and where they come from (for messages). chat: renders a chat's
    messages as a prompt (generation from `task.messages_field`). pin: the commit of a hub dataset
    the run fetched (distzo.run.hub_pins; a process on its own fetches it here when None)."""
    name = cfg.dataset
    if name in BUNDLED:
        parts = {"all": bundled_records(name, cfg.num_examples, cfg.split_seed)}
        origin = f"the bundled {name} set"
    elif name == "trivia":
        parts = {"all": trivia_records(cfg.path, list(cfg.subsets))}
        origin = f"the trivia lists {list(cfg.subsets)}"
    elif hub.is_hub_id(cfg.path):
        parts, origin = hub_records(cfg, pin, JSON_OBJECTS.get(name))
    else:
        if not cfg.path:
            raise DataError(f"task={cfg.name} needs data: add task.path=org/name (a hub dataset) or "
                            "task.path=/path/to/the/data (a file, a folder of split files, or a datasets export; "
                            "docs/tasks.md)")
        parts = read_records(cfg.path, str(cfg.format), JSON_OBJECTS.get(name), cfg.subset, split_names(cfg))
        origin = cfg.path
    formatter = RecordFormatter(cfg, kind_type(cfg.kind), READERS.get(name), chat)
    examples = {split: formatter.examples(records, split, origin) for split, records in parts.items()}
    splits = make_splits(examples, cfg.val_size, cfg.test_size, cfg.train_size, cfg.split_seed, origin)
    for split in SPLITS:
        if not getattr(splits, split):
            raise DataError(f"the {split} split of {origin} is empty; give it examples (or lower task.val_size / "
                            "task.test_size when splitting one file)")
    return splits, origin


class EncodedPrompts(Sequence[list[int]]):
    """A split's prompts as token ids, each encoded when first read and kept. A run reads the
    examples its steps and evaluations draw (5 steps of 16 read 80 of the 10,603 movie reviews), and
    encoding every prompt up front cost each run and each rank about a second at start. A step that
    first reads an example pays its encoding (0.05-0.1 ms) in its time. Everything is encoded at the
    start where the task needs all (task.max_tokens; the longest sequence, for a model with learned
    positions)."""

    def __init__(self, texts: list[str], encode: Callable[[str], list[int]]):
        self._texts, self._encode = texts, encode
        self._ids: list[list[int] | None] = [None] * len(texts)

    def __len__(self) -> int:
        return len(self._texts)

    @overload
    def __getitem__(self, i: int) -> list[int]: ...

    @overload
    def __getitem__(self, i: slice) -> list[list[int]]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        ids = self._ids[i]
        if ids is None:
            ids = self._ids[i] = self._encode(self._texts[i])
        return ids

    def __setitem__(self, i: int, ids: list[int]) -> None:
        self._ids[i] = ids


class PromptTask:
    """A classification or multiple-choice task over prompts (see the module docstring). pin: the
    commit of a hub dataset the run fetched (`task.path=org/name`; None: fetched here)."""

    def __init__(self, cfg: TaskConfig, tokenizer, objective: str = "loss", pin: hub.Pin | None = None):
        self.name, self.kind, self.max_length = cfg.name, str(cfg.kind), cfg.max_length
        self.kind_type = kind_type(cfg.kind)  # what this kind reads, scores and trains on (distzo.data.kinds)
        self.scores_candidates = self.kind_type.scores_candidates  # evaluation: accuracy over candidates
        self.messages_field = cfg.messages_field
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.label_words = list(cfg.label_words)
        self.stop, self.max_new_tokens = cfg.stop, cfg.max_new_tokens
        self.origin = cfg.path or cfg.dataset  # for messages while the data is read
        self.splits, self.origin = load_examples(cfg, self._render_chat, pin)
        self.decodes = self.kind_type.decodes([ex for s in SPLITS for ex in getattr(self.splits, s)])
        self.num_demos = cfg.demos
        self.demos = self._demonstrations(cfg.demos, cfg.demo_separator, cfg.split_seed)
        self.decoding_objective = str(objective) in ("f1", "exact_match")
        self.teacher_forcing = self.kind_type.teacher_forcing(str(cfg.loss), str(objective))
        self.label_ids = self.kind_type.label_ids(self)  # None unless every candidate is one shared token
        self._check_prompts_can_start()
        self._prompts = {s: EncodedPrompts([ex.prompt for ex in getattr(self.splits, s)], self.encode)
                         for s in SPLITS}
        self._candidates: dict[str, list[list[list[int]]]] = {}
        if self.label_ids is None:
            cache: dict[str, list[int]] = {}
            self._candidates = {s: [[self._continuation(c, cache) for c in ex.candidates]
                                    for ex in getattr(self.splits, s)] for s in SPLITS}
        if cfg.max_tokens is not None:
            self._cap_sequences(cfg.max_tokens)
        self._labels = {s: torch.tensor([ex.label for ex in getattr(self.splits, s)], dtype=torch.long) for s in SPLITS}
        self._gold = {s: [ex.gold for ex in getattr(self.splits, s)] for s in SPLITS}
        self._answers = {s: [ex.answers for ex in getattr(self.splits, s)] for s in SPLITS}

    # --- encoding --------------------------------------------------------------------------------

    def _render_chat(self, messages: list[dict]) -> str:
        """A chat's messages up to the assistant's answer, as the tokenizer's chat template renders
        them with the assistant's turn opened."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise DataError(f"{self.origin}: chat messages need a chat template, and this tokenizer has none; use a "
                            "chat model's tokenizer (model.tokenizer=...), or prompt and completion fields")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _demonstrations(self, k: int, separator: str, seed: int) -> str:
        if not k:
            return ""
        train = self.splits.train
        if k >= len(train):
            raise DataError(f"task.demos={k} needs more than {k} training examples ({self.origin} has {len(train)})")
        picked = random.Random(seed + 3).sample(range(len(train)), k)
        # Demonstrations are drawn from, and removed from, the training split: no example is its own demo.
        self.splits.train = [ex for i, ex in enumerate(train) if i not in set(picked)]
        return "".join(train[i].prompt + train[i].candidates[train[i].label] + separator for i in picked)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a prompt (after the demonstrations, if any), at most `max_length`, keeping the
        end: the template's cue is there."""
        ids = self.tokenizer(self.demos + prompt).input_ids
        eos, bos = self.tokenizer.eos_token_id, self.tokenizer.bos_token_id
        # Some tokenizers append EOS; the prompt must end on its own last token.
        if eos is not None and len(ids) > 1 and ids[-1] == eos and eos != bos:
            ids = ids[:-1]
        if not ids:  # an empty prompt (a text modelled whole) starts at the document boundary
            if bos is None and eos is None:
                raise self._no_start_token()
            ids = [bos if bos is not None else eos]
        return ids[-self.max_length:]

    def _no_start_token(self) -> DataError:
        return DataError(f"task {self.name}: a record has no prompt, and this tokenizer has no beginning- or "
                         "end-of-sequence token to start it with; give the records a prompt")

    def _check_prompts_can_start(self) -> None:
        """Prompts are encoded when first read (EncodedPrompts); an empty one that could not be
        encoded is refused here, before the run, rather than when a step draws it."""
        if self.tokenizer.bos_token_id is None and self.tokenizer.eos_token_id is None and not self.demos:
            if any(not ex.prompt for split in SPLITS for ex in getattr(self.splits, split)):
                raise self._no_start_token()

    def _cap_sequences(self, limit: int) -> None:
        """task.max_tokens: every sequence at most `limit` tokens, prompt and completion. A completion
        loses its end; a prompt that leaves no room keeps its last limit - 1 tokens (as max_length
        keeps a prompt's end) and the completion its first token."""
        cut = total = 0
        for split in SPLITS:
            prompts, candidates = self._prompts[split], self._candidates[split]
            for i, prompt in enumerate(prompts):
                total += 1
                kept = prompt[-(limit - 1):]
                capped = [c[:limit - len(kept)] for c in candidates[i]]
                if len(kept) < len(prompt) or capped != candidates[i]:
                    prompts[i], candidates[i] = kept, capped
                    cut += 1
        if cut:
            log.info("task %s: %d of %d sequences cut to task.max_tokens=%d tokens", self.name, cut, total, limit)

    def _continuation(self, text: str, cache: dict[str, list[int]]) -> list[int]:
        """A candidate's tokens, encoded on their own (so every candidate follows the same prompt tokens)."""
        if text not in cache:
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            if not ids:
                raise DataError(f"task {self.name}: the candidate {text!r} encodes to no token; give every candidate "
                                "some text")
            cache[text] = ids
        return cache[text]

    # --- batches ---------------------------------------------------------------------------------

    def longest_sequence(self) -> int:
        """The most tokens one forward pass of this task reads: a prompt and its longest candidate,
        plus the tokens evaluation generates when it decodes answers."""
        longest = 0
        for split in SPLITS:
            candidates = self._candidates.get(split)
            for i, prompt in enumerate(self._prompts[split]):
                extra = max((len(c) for c in candidates[i]), default=0) if candidates else 1
                longest = max(longest, len(prompt) + extra)
        return longest + (self.max_new_tokens if self.decodes else 0)

    def size(self, split: str) -> int:
        return len(self._prompts[split])

    def batch(self, split: str, indices: Sequence[int]) -> Batch:
        """A scoring batch, as the kind scores its examples: every candidate of every example (see the
        module docstring); for generation, the completion's tokens (its loss; what is generated is
        scored by `answers`)."""
        return self.kind_type.batch(self, split, list(indices))

    def candidate_batch(self, split: str, indices: list[int]) -> Batch:
        """Every candidate of every example after its prompt (the label-word head when each
        candidate is one shared token); readout `likelihoods`."""
        prompts = [self._prompts[split][i] for i in indices]
        labels = self._labels[split][indices]
        extra = {"gold": [self._gold[split][i] for i in indices]}
        if self.label_ids is not None:
            batch = label_word_batch(prompts, labels, self.label_ids, self.pad_id)
            batch.extra = extra
            return batch
        sequences, units = [], []
        for e, (i, prompt) in enumerate(zip(indices, prompts)):
            candidates = self._candidates[split][i]
            sequences.append(candidate_sequence(prompt, candidates, len(units)))
            units += [e] * len(candidates)
        return Batch(sequences, list(range(len(indices))), units, labels, None, self.pad_id, "likelihoods", extra)

    def train_batch(self, indices: Sequence[int]) -> Batch:
        """The training step's batch: the scoring batch, or with teacher forcing the right candidate's
        tokens after each prompt (one unit per example)."""
        if self.decoding_objective:
            return self.decode_batch("train", indices)
        if not self.teacher_forcing:
            return self.batch("train", indices)
        return self.completion_batch("train", list(indices))

    def decode_batch(self, split: str, indices: Sequence[int]) -> Batch:
        """The prompts alone, to be continued greedily by `max_new_tokens` tokens under each
        evaluation's weights (readout `decode`): the step of a decoding objective (f1, exact_match)."""
        indices = list(indices)
        n = len(indices)
        sequences = [Seq(tuple(self._prompts[split][i])) for i in indices]
        return Batch(sequences, list(range(n)), [], self._labels[split][indices], None, self.pad_id, "decode",
                     {"answers": [self._answers[split][i] for i in indices]}, self.max_new_tokens)

    def objective_sums(self, scores: Scores, batch: Batch, objective: str) -> torch.Tensor:
        """[2] float64 (sum, count) of the training objective: for f1 and exact_match, minus the sum of
        the greedy answers' scores over the batch's examples (ZO needs only the value); otherwise
        `distzo.data.objectives.objective_sums`."""
        if batch.readout != "decode":
            return objective_sums(scores, batch, objective)
        metric = f1_score if objective == "f1" else exact_match
        answers = [answer_text(self.tokenizer, tokens, self.stop) for tokens in scores.generated]
        total = sum(metric(a, ok) for a, ok in zip(answers, batch.extra["answers"]))
        return torch.tensor([-total, float(batch.size)], dtype=torch.float64)

    def completion_batch(self, split: str, indices: list[int]) -> Batch:
        """The right candidate's (the completion's) tokens after each prompt, one unit per example;
        readout `tokens`. Prompts and answers ride along for decoding objectives (`extra`)."""
        sequences = []
        for e, i in enumerate(indices):
            prompt = self._prompts[split][i]
            gold = self._candidates[split][i][self._labels[split][i]]
            sequences.append(candidate_sequence(prompt, [gold], e))
        n = len(indices)
        extra = {"prompts": [self._prompts[split][i] for i in indices],
                 "answers": [self._answers[split][i] for i in indices]}
        return Batch(sequences, list(range(n)), list(range(n)), self._labels[split][indices], None, self.pad_id,
                     "tokens", extra)

    def batches(self, split: str, batch_size: int) -> Iterator[Batch]:
        n = self.size(split)
        for lo in range(0, n, batch_size):
            yield self.batch(split, range(lo, min(lo + batch_size, n)))

    def describe(self) -> str:
        words, loss = self.kind_type.describe(self)
        return (f"Task {self.name} ({self.kind}, {words}; training loss: {loss}): {self.size('train')} train / "
                f"{self.size('validation')} validation / {self.size('test')} test examples from {self.origin}"
                + (f"; {self.num_demos} solved examples before each prompt" if self.num_demos else ""))


def candidate_sequence(prompt: Sequence[int], candidates: Sequence[Sequence[int]], first_unit: int) -> Seq:
    """A prompt followed by its candidates as branches: candidate c is unit first_unit + c, scored at
    the positions that predict its tokens (the prompt's last position for its first token). One
    candidate makes a plain sequence."""
    tokens = list(prompt)
    branches, scored, targets, units = [], [], [], []
    for c, cand in enumerate(candidates):
        start = len(tokens)
        branches.append(start)
        tokens += cand
        scored += [len(prompt) - 1] + list(range(start, start + len(cand) - 1))
        targets += list(cand)
        units += [first_unit + c] * len(cand)
    return Seq(tuple(tokens), tuple(branches) if len(candidates) > 1 else (), tuple(scored), tuple(targets),
               tuple(units))


class TrainSampler:
    """Global batches as a pure function of (data seed, step): successive shuffled epochs, read in
    order. No state to save; resuming at step t or changing the mesh gives the same batches."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._perm_epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=gen), epoch
        return self._perm

    def indices(self, step: int) -> list[int]:
        out = []
        for pos in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, offset = divmod(pos, self.n)
            out.append(int(self._permutation(epoch)[offset]))
        return out

