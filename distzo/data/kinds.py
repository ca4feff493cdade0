"""Task kinds: what a task of each `task.kind` reads from a record, scores, trains on and reports.

One class per kind holds everything that differs between kinds, so the rest of distzo never compares
the kind's name: the settings it reads and their checks, the objectives it can train on, how a record
becomes an `Example`, which batch scores it, whether it trains by teacher forcing, and how evaluation
reads its scores. Each is registered by name (`@register("task_kind", name)`, distzo.registry): the
values of `task.kind`:

- classification: one label word per class after a template (`task.label_words`), the record's class
  from `task.label_field`;
- multiple_choice: each record brings its own candidates (`task.candidates_field` or
  `task.candidate_fields`), the right one(s) named by `task.label_field`;
- generation: a prompt and a completion (a template over the record and `task.answers_field`, or the
  standard SFT layouts: prompt/completion, a chat's messages, a whole text). Records with answers
  are decoded and scored by exact match and F1; plain texts are language modelling, reported by
  their token loss and perplexity.

A new kind is one registered class, here or in a module of your own named by DISTZO_PLUGINS; it
reads the task section's fields. The record parsing helpers the kinds share (templates, the record's
fields) are `RecordFormatter`'s (`distzo.data.examples`), which each method receives as `fmt`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch

from ..config.schema import TaskConfig
from ..errors import ConfigError
from ..registry import register, registry
from .examples import Example, answer_list, norm, template_fields
from .records import DataError

log = logging.getLogger("distzo")

if TYPE_CHECKING:  # the task calls its kind with itself
    from .batches import Batch
    from .examples import RecordFormatter
    from .tasks import PromptTask


def format_string(template: str, key: str) -> list[str]:
    """The fields of a configured format string; ConfigError when it is not one."""
    try:
        names = template_fields(template)
    except ValueError as exc:
        raise ConfigError(f"{key}={template!r} is not a valid format string ({exc}); write fields as {{name}} and a "
                          "literal brace as {{ or }}") from None
    for name in names:
        if "." in name:  # str.format's attribute access: {review.upper} renders a method's repr
            raise ConfigError(f"{key}={template!r} reads {{{name}}}, an attribute of a field, which renders as "
                              "Python's text for that object; read fields by name ({review}), or a nested field "
                              "by key ({meta[title]})")
    return names


class Kind:
    """A task kind's behaviour (see the module docstring). Stateless: classmethods over the task
    settings `t`, the record formatter `fmt` or the task."""

    name: ClassVar[str]
    # Settings that only this kind reads, and the line naming the mistake when another kind is set.
    reads: ClassVar[dict[tuple[str, ...], str]] = {}
    # Whether evaluation compares the candidates' scores (accuracy); generation reads answers or tokens.
    scores_candidates: ClassVar[bool] = True

    @classmethod
    def check(cls, t: TaskConfig, bundled: bool) -> None:
        """The task settings this kind needs (before the data is read). bundled: the data is one of
        distzo's bundled sets. Raises ConfigError."""

    @classmethod
    def check_objective(cls, objective: str, task_name: str) -> None:
        """Raises ConfigError for an `objective` this kind cannot train on."""
        if objective in ("f1", "exact_match"):
            raise ConfigError(f"objective={objective} scores generated answers; task {task_name} is {cls.name}: use "
                              "objective=loss or objective=accuracy")

    # --- records -> examples -----------------------------------------------------------------------

    @classmethod
    def layout(cls, fmt: RecordFormatter, fields: set[str]) -> str:
        """How the current split's records give their example, from the fields they carry."""
        return "template"

    @classmethod
    def answer_key(cls, fmt: RecordFormatter) -> tuple[str, str]:
        """The record field holding the answer, and the setting that names it."""
        return fmt.label_field, "task.label_field"

    @classmethod
    def has_label(cls, fmt: RecordFormatter, record: dict[str, Any]) -> bool:
        """Whether a (rewritten) record says which answer is right (test splits of GLUE and
        SuperGLUE do not)."""
        value = record.get(fmt.label_field)
        return value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0)

    @classmethod
    def example(cls, fmt: RecordFormatter, row: dict[str, Any], where: str) -> Example:
        raise NotImplementedError

    # --- examples -> training and evaluation ---------------------------------------------------------

    @classmethod
    def teacher_forcing(cls, loss: str, objective: str) -> bool:
        """Whether training scores the right candidate's tokens (instead of a loss over candidates)."""
        return loss == "teacher_forcing" and objective != "accuracy"

    @classmethod
    def decodes(cls, examples: Sequence[Example]) -> bool:
        """Whether evaluation decodes answers (exact match and F1)."""
        return False

    @classmethod
    def label_ids(cls, task: PromptTask) -> torch.Tensor | None:
        """The label words' token ids when every candidate is one shared token (the label-word
        head, one forward per prompt); None otherwise."""
        return None

    @classmethod
    def batch(cls, task: PromptTask, split: str, indices: list[int]) -> Batch:
        """The evaluation batch of a split's examples."""
        return task.candidate_batch(split, indices)

    @classmethod
    def describe(cls, task: PromptTask) -> tuple[str, str]:
        """What the candidates are, and the training loss, for the task's description."""
        return ("", "teacher forcing on the right candidate" if task.teacher_forcing
                else "cross-entropy over the candidates")


@register("task_kind", "classification")
class Classification(Kind):

    @classmethod
    def check(cls, t: TaskConfig, bundled: bool) -> None:
        words = list(t.label_words)
        if len(words) < 2:
            raise ConfigError("task.label_words needs at least two label words (one per class)")
        if len(set(words)) != len(words):
            raise ConfigError(f"task.label_words={words} repeats a word; give one distinct word per class")
        if t.labels is not None and (len(t.labels) != len(words) or len(set(map(str, t.labels))) != len(words)):
            raise ConfigError(f"task.labels={list(t.labels)} must name {len(words)} distinct label values, one per "
                              f"label word of task.label_words={words}, in the same order")

    @classmethod
    def example(cls, fmt: RecordFormatter, row: dict[str, Any], where: str) -> Example:
        prompt = fmt.format(fmt.template, row, where, "task.template")
        return Example(prompt, tuple(fmt.label_words), (cls._class(fmt, row, where),))

    @staticmethod
    def _class(fmt: RecordFormatter, row: dict[str, Any], where: str) -> int:
        if "_label" in row:
            return int(row["_label"])
        raw = row.get(fmt.label_field)
        n = len(fmt.label_words)
        if isinstance(raw, float) and raw.is_integer():  # a column arrow read as floats (one record held 1.5)
            forms = [norm(int(raw)), norm(raw)]  # 0.0 is label 0 (or a label written 0.0)
            raw = int(raw)
        else:
            forms = [norm(raw)]
        if fmt.labels is not None:
            known = [f for f in forms if f in fmt.labels]
            if not known:
                raise DataError(f"{where} has label {raw!r}, which is not in task.labels={list(fmt.labels)}; add it "
                                "(in the order of task.label_words) or fix the record")
            return fmt.labels.index(known[0])
        if isinstance(raw, bool) or not str(raw).strip().lstrip("-").isdigit():
            raise DataError(f"{where} has label {raw!r}, not a class index; set task.labels to the label values in the "
                            f"order of task.label_words (e.g. task.labels=[negative,positive])")
        index = int(str(raw).strip())
        if not 0 <= index < n:
            raise DataError(f"{where} has label {index}, but task.label_words has {n} words (classes 0..{n - 1}); "
                            "add a label word for every class")
        return index

    @classmethod
    def label_ids(cls, task: PromptTask) -> torch.Tensor | None:
        ids = [task.tokenizer(w, add_special_tokens=False).input_ids for w in task.label_words]
        empty = [w for w, t in zip(task.label_words, ids) if not t]
        if empty:
            raise DataError(f"task.label_words: {empty[0]!r} encodes to no token; use a non-empty word")
        if any(len(t) != 1 for t in ids):
            log.info("task %s: label words of several tokens %s; each is scored by its mean token log-likelihood",
                     task.name, [w for w, t in zip(task.label_words, ids) if len(t) > 1])
            return None
        if len({t[0] for t in ids}) != len(ids):
            raise DataError(f"task.label_words={task.label_words} encode to the same token; choose words that differ")
        return torch.tensor([t[0] for t in ids], dtype=torch.long)

    @classmethod
    def describe(cls, task: PromptTask) -> tuple[str, str]:
        return f"label words {task.label_words}", super().describe(task)[1]


@register("task_kind", "multiple_choice")
class MultipleChoice(Kind):
    reads = {("candidates_field", "candidate_fields"): (
        "task.candidates_field / task.candidate_fields are read by task.kind=multiple_choice only; add "
        "task.kind=multiple_choice, or use task.label_words for classification")}

    @classmethod
    def check(cls, t: TaskConfig, bundled: bool) -> None:
        if "candidate" not in format_string(t.candidate_template, "task.candidate_template"):
            raise ConfigError(f"task.candidate_template={t.candidate_template!r} must contain {{candidate}}")
        if t.dataset in ("file",) and not t.candidates_field and not t.candidate_fields:
            raise ConfigError("task.kind=multiple_choice needs the record's candidates: task.candidates_field=<a list "
                              "field> or task.candidate_fields=[<one field per candidate>, ...]")
        if list(t.label_words) != list(TaskConfig().label_words):  # the default's words: not set
            raise ConfigError(f"task.label_words={list(t.label_words)} is read by task.kind=classification only; a "
                              "multiple-choice record brings its own candidates (task.candidates_field or "
                              "task.candidate_fields): drop task.label_words, or use task.kind=classification")

    @classmethod
    def example(cls, fmt: RecordFormatter, row: dict[str, Any], where: str) -> Example:
        prompt = fmt.format(fmt.template, row, where, "task.template")
        candidates, gold = cls._choices(fmt, row, where)
        return Example(prompt, tuple(candidates), gold)

    @classmethod
    def _choices(cls, fmt: RecordFormatter, row: dict[str, Any], where: str) -> tuple[list[str], tuple[int, ...]]:
        if "_candidates" in row:
            raw, gold_raw = list(row["_candidates"]), row["_gold"]
        else:
            if fmt.candidates_field:
                raw = row.get(fmt.candidates_field)
                if not isinstance(raw, (list, tuple)):
                    raise DataError(f"{where} has no list of candidates in field {fmt.candidates_field!r}; set "
                                    "task.candidates_field to a field holding a list, or task.candidate_fields to "
                                    "the fields that each hold one candidate")
            else:
                missing = [f for f in fmt.candidate_fields if f not in row]
                if missing or not fmt.candidate_fields:
                    raise DataError(f"{where} lacks the candidate field(s) {missing or '(none configured)'}; set "
                                    "task.candidate_fields (or task.candidates_field) to fields the records have")
                raw = [row[f] for f in fmt.candidate_fields]
            gold_raw = row.get(fmt.label_field)
        raw = [str(c) for c in raw]
        if len(raw) < 2:
            raise DataError(f"{where} has {len(raw)} candidate(s); multiple choice needs at least two")
        gold = cls._gold(fmt, gold_raw, raw, where)
        candidates = [fmt.format(fmt.candidate_template, row, where, "task.candidate_template", candidate=c)
                      for c in raw]
        return candidates, gold

    @staticmethod
    def _gold(fmt: RecordFormatter, value: Any, candidates: list[str], where: str) -> tuple[int, ...]:
        values = value if isinstance(value, (list, tuple)) else [value]
        gold = []
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(candidates):
                gold.append(v)
            elif str(v) in candidates:
                gold.append(candidates.index(str(v)))
            elif str(v).strip().isdigit() and 0 <= int(str(v).strip()) < len(candidates):
                gold.append(int(str(v).strip()))
            else:
                raise DataError(f"{where}: the answer {v!r} is neither the index nor the text of one of its "
                                f"{len(candidates)} candidates; fix the record or task.label_field")
        if not gold:
            raise DataError(f"{where} names no right answer; give {fmt.label_field!r} an index or a candidate's text")
        return tuple(dict.fromkeys(gold))

    @classmethod
    def describe(cls, task: PromptTask) -> tuple[str, str]:
        return "per-example candidates", super().describe(task)[1]


@register("task_kind", "generation")
class Generation(Kind):
    reads = {("messages_field",): ("task.messages_field (a chat) is read by task.kind=generation only; add "
                                   "task.kind=generation"),
             ("max_tokens",): ("task.max_tokens caps a generation task's sequences (prompt and completion); the "
                               "prompts of classification and multiple choice are capped by task.max_length")}
    scores_candidates = False

    @classmethod
    def check(cls, t: TaskConfig, bundled: bool) -> None:
        if bundled:
            raise ConfigError(f"task.kind=generation needs data with answers; the bundled {t.dataset} set has "
                              "none (use task=custom task.path=... or a generation preset)")
        if "answer" not in format_string(t.completion_template, "task.completion_template"):
            raise ConfigError(f"task.completion_template={t.completion_template!r} must contain {{answer}}")

    @classmethod
    def check_objective(cls, objective: str, task_name: str) -> None:
        if objective == "accuracy":
            raise ConfigError(f"objective=accuracy compares candidates; task {task_name} generates answers: use "
                              "objective=loss, objective=exact_match or objective=f1")

    @classmethod
    def layout(cls, fmt: RecordFormatter, fields: set[str]) -> str:
        """How a split's records give their prompt and completion: "template" (the configured
        `answers_field`, or a preset's answers), "messages" (`messages_field`, or a `messages`
        list), "prompt_completion" (`prompt` and `completion`) or "text" (a `text` field, modelled
        whole). The configured fields win; the standard layouts need no settings."""
        if fmt.messages_field:
            return "messages"
        if "_answers" in fields or fmt.answers_field in fields:
            return "template"
        if {"prompt", "completion"} <= fields:
            return "prompt_completion"
        for layout, field in (("messages", "messages"), ("text", "text")):
            if field in fields:
                return layout
        return "template"  # reports the missing answers field

    @classmethod
    def answer_key(cls, fmt: RecordFormatter) -> tuple[str, str]:
        field = {"messages": fmt.messages_field or "messages", "prompt_completion": "completion",
                 "text": "text"}.get(fmt.layout, fmt.answers_field)
        return field, "task.answers_field"

    @classmethod
    def has_label(cls, fmt: RecordFormatter, record: dict[str, Any]) -> bool:
        return bool(record.get(cls.answer_key(fmt)[0]))

    @classmethod
    def example(cls, fmt: RecordFormatter, row: dict[str, Any], where: str) -> Example:
        """A prompt and its completion, by the record's layout. A text is modelled whole: an empty
        prompt (the task starts it at the tokenizer's document boundary) and no answers to decode."""
        layout = fmt.layout
        if layout == "messages":
            field = fmt.messages_field or "messages"
            prompt, answer = cls._chat_turns(fmt, row.get(field), where, field)
            return Example(prompt, (answer + fmt.stop,), (0,), (answer,))
        if layout == "prompt_completion":
            prompt, completion = row["prompt"], row["completion"]
            if isinstance(prompt, (list, tuple)):  # conversational: message lists on both sides
                prompt, answer = cls._chat_turns(fmt, list(prompt) + list(completion or [])[-1:], where, "prompt")
            else:
                prompt, answer = str(prompt), str(completion)
            return Example(prompt, (answer + fmt.stop,), (0,), (answer.strip(),))
        if layout == "text":
            text = str(row["text"])
            if not text.strip():
                raise DataError(f"{where} has an empty 'text'; give every record some text")
            return Example("", (text,), (0,), ())
        answers = row["_answers"] if "_answers" in row else answer_list(row.get(fmt.answers_field))
        if not answers:
            fields = sorted(k for k in row if not k.startswith("_"))
            raise DataError(f"{where} has no answer in {fmt.answers_field!r} (its fields: {fields}); generation "
                            "reads prompt and completion fields, a messages list or a text field as they are, or "
                            "set task.answers_field to the field holding the answer (with task.template for the "
                            "prompt)")
        prompt = fmt.format(fmt.template, row, where, "task.template")
        completion = fmt.format(fmt.completion_template, row, where, "task.completion_template", answer=answers[0])
        return Example(prompt, (completion + fmt.stop,), (0,), tuple(answers))

    @staticmethod
    def _chat_turns(fmt: RecordFormatter, messages: Any, where: str, field: str) -> tuple[str, str]:
        """A chat's prompt (every message before the last, rendered by the tokenizer's chat template
        with the assistant's turn opened) and its completion (the last message, the assistant's)."""
        if (not isinstance(messages, (list, tuple)) or not messages or not isinstance(messages[-1], dict)
                or messages[-1].get("role") != "assistant"):
            raise DataError(f"{where}: {field!r} must be a list of chat messages ending with the "
                            "assistant's ({'role': 'assistant', 'content': ...}), the completion to learn")
        return fmt.chat(list(messages[:-1])), str(messages[-1].get("content", ""))

    @classmethod
    def teacher_forcing(cls, loss: str, objective: str) -> bool:
        return True  # the completion's tokens

    @classmethod
    def decodes(cls, examples: Sequence[Example]) -> bool:
        # Records that are plain texts (no answers to decode) are language modelling.
        return any(ex.answers for ex in examples)

    @classmethod
    def batch(cls, task: PromptTask, split: str, indices: list[int]) -> Batch:
        return task.completion_batch(split, indices)

    @classmethod
    def describe(cls, task: PromptTask) -> tuple[str, str]:
        if task.decodes:
            return (f"greedy decoding of up to {task.max_new_tokens} tokens, stop {task.stop!r}",
                    "teacher forcing on the completion")
        return "language modelling on whole texts, scored by perplexity", "token loss of the whole text"


def kind_type(name: Any) -> type[Kind]:
    """The class of `task.kind=name` (the built-in kinds and DISTZO_PLUGINS')."""
    return registry("task_kind").get(name)
