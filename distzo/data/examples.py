"""From records to examples: what a prompted task scores.

An `Example` is a prompt, the candidate continuations scored after it, and which of them are right.
For classification the candidates are the verbalizers (`task.label_words`, the same for every
example) and the gold one is the record's class; for multiple choice every record brings its own
candidates (COPA's two choices, ReCoRD's entities, the options of a user's file).

`RecordFormatter` builds examples from records the way `task` configures: `template` is a Python
format string over the record's fields (`{premise}`, `{question}`, any field a file has), the label
is read from `label_field` and mapped to a class through `labels` (when the file's labels are
strings or booleans) or taken as the class index; multiple-choice candidates come from one list field
(`candidates_field`) or from several fields (`candidate_fields`), each rendered with
`candidate_template`. A preset may first rewrite a record (`distzo.data.presets`): it returns the
fields the template reads plus `_label` (a class index) or `_candidates` and `_gold`.

Generation reads the record layouts SFT data comes in without settings (`sft_layout`): the
configured `answers_field` under `template`; else `prompt` and `completion` fields (TRL's
prompt-completion format, plain or conversational); a chat `messages` list (the last message, the
assistant's, is the completion); or a `text` field (language modelling on the whole text).

Every mistake names the file, the record and the fix (`DataError`).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .sources import DataError


@dataclass(frozen=True)
class Example:
    """prompt: the text before the candidates; candidates: the continuations scored after it (each
    carries its own leading space or newline); gold: the indices of the right candidates (the first
    is the training target of teacher forcing). A generation example has one candidate, the
    completion it is trained to produce, and the answers its output is compared with."""

    prompt: str
    candidates: tuple[str, ...]
    gold: tuple[int, ...]
    answers: tuple[str, ...] = ()  # generation: the accepted answers (exact match and F1)

    @property
    def label(self) -> int:
        return self.gold[0]


def template_fields(template: str) -> list[str]:
    """The field names a format string reads, in order ("{premise} so" -> ["premise"])."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def _norm(value: Any) -> str:
    return str(value).strip().lower()


class RecordFormatter:
    """Turns one split's records into Examples (see the module docstring).

    kind: "classification" or "multiple_choice"; origin: the file (or set) the records come from,
    for messages; rewrite: a preset's record rewrite (None: the record's own fields)."""

    def __init__(self, cfg, rewrite: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
                 chat: Callable[[list[dict[str, Any]]], str] | None = None):
        self.kind = str(cfg.kind)
        self.answers_field, self.completion_template, self.stop = cfg.answers_field, cfg.completion_template, cfg.stop
        self.messages_field, self.chat = cfg.messages_field, chat
        self.template = cfg.template
        self.label_field = cfg.label_field
        self.labels = [_norm(v) for v in cfg.labels] if cfg.labels else None
        self.label_words = tuple(cfg.label_words)
        self.candidates_field = cfg.candidates_field
        self.candidate_fields = list(cfg.candidate_fields or [])
        self.candidate_template = cfg.candidate_template
        self.rewrite = rewrite
        self.fields = template_fields(self.template)
        self.layout = "template"  # generation: the current split's record layout (`sft_layout`)

    def sft_layout(self, fields: set[str]) -> str:
        """How a split's generation records give their prompt and completion, from the fields they
        carry: "template" (the configured `answers_field`, or a preset's answers), "messages"
        (`messages_field`, or a `messages` list), "prompt_completion" (`prompt` and `completion`)
        or "text" (a `text` field, modelled whole). The configured fields win; the standard layouts
        need no settings."""
        if self.messages_field:
            return "messages"
        if "_answers" in fields or self.answers_field in fields:
            return "template"
        if {"prompt", "completion"} <= fields:
            return "prompt_completion"
        for layout, field in (("messages", "messages"), ("text", "text")):
            if field in fields:
                return layout
        return "template"  # reports the missing answers field

    def _answer_field(self) -> str:
        """The field that holds a generation record's completion, in the split's layout."""
        return {"messages": self.messages_field or "messages", "prompt_completion": "completion",
                "text": "text"}.get(self.layout, self.answers_field)

    def has_label(self, record: dict[str, Any]) -> bool:
        """Whether a (rewritten) record says which answer is right (test splits of GLUE and SuperGLUE
        do not)."""
        if "_label" in record or "_gold" in record or "_answers" in record:
            return next(record[k] for k in ("_label", "_gold", "_answers") if k in record) is not None
        if self.kind == "generation":
            return bool(record.get(self._answer_field()))
        value = record.get(self.label_field)
        return value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0)

    def examples(self, records: Sequence[dict[str, Any]], split: str, origin: str) -> list[Example] | None:
        """The examples of a split; None when no record of it carries a label (an unlabelled test
        split), an error when only some lack one."""
        rows = self.rewrite(list(records)) if self.rewrite else list(records)
        # A file's records share its columns (missing values read as None): the layout is what the
        # split's records carry.
        self.layout = self.sft_layout({k for r in rows for k, v in r.items() if v is not None})
        labelled = [self.has_label(r) for r in rows]
        if rows and not any(labelled):
            return None
        out = []
        for i, (row, ok) in enumerate(zip(rows, labelled)):
            where = f"record {i} of the {split} split of {origin}"
            if not ok:
                key = "task.answers_field" if self.kind == "generation" else "task.label_field"
                field = self._answer_field() if self.kind == "generation" else self.label_field
                raise DataError(f"{where} has no {field!r} (the answer), though other records do; "
                                f"give every record its answer, or set {key} to the field that holds it")
            out.append(self.example(row, where))
        return out

    def example(self, row: dict[str, Any], where: str) -> Example:
        if self.kind == "generation":
            return self._generation(row, where)
        prompt = self._format(self.template, row, where, "task.template")
        if self.kind == "multiple_choice":
            candidates, gold = self._choices(row, where)
        else:
            candidates, gold = self.label_words, (self._class(row, where),)
        return Example(prompt, tuple(candidates), gold)

    def _format(self, template: str, row: dict[str, Any], where: str, key: str, **extra: Any) -> str:
        try:
            return template.format(**{**row, **extra})
        except KeyError as exc:
            fields = sorted(k for k in row if not k.startswith("_"))
            raise DataError(f"{key}={template!r} reads the field {exc.args[0]!r}, but {where} has only {fields}; "
                            f"use those names in {key}") from None
        except (IndexError, ValueError) as exc:
            raise DataError(f"{key}={template!r} is not a valid format string ({exc}); write fields as {{name}} "
                            "and a literal brace as {{ or }}") from None

    def _generation(self, row: dict[str, Any], where: str) -> Example:
        """A prompt and its completion, by the record's layout (`sft_layout`). A text is modelled
        whole: an empty prompt (the task starts it at the tokenizer's document boundary) and no
        answers to decode."""
        layout = self.layout
        if layout == "messages":
            field = self.messages_field or "messages"
            prompt, answer = self._chat_turns(row.get(field), where, field)
            return Example(prompt, (answer + self.stop,), (0,), (answer,))
        if layout == "prompt_completion":
            prompt, completion = row["prompt"], row["completion"]
            if isinstance(prompt, (list, tuple)):  # conversational: message lists on both sides
                prompt, answer = self._chat_turns(list(prompt) + list(completion or [])[-1:], where, "prompt")
            else:
                prompt, answer = str(prompt), str(completion)
            return Example(prompt, (answer + self.stop,), (0,), (answer.strip(),))
        if layout == "text":
            text = str(row["text"])
            if not text.strip():
                raise DataError(f"{where} has an empty 'text'; give every record some text")
            return Example("", (text,), (0,), ())
        answers = row["_answers"] if "_answers" in row else _answer_list(row.get(self.answers_field))
        if not answers:
            fields = sorted(k for k in row if not k.startswith("_"))
            raise DataError(f"{where} has no answer in {self.answers_field!r} (its fields: {fields}); generation "
                            "reads prompt and completion fields, a messages list or a text field as they are, or "
                            "set task.answers_field to the field holding the answer (with task.template for the "
                            "prompt)")
        prompt = self._format(self.template, row, where, "task.template")
        completion = self._format(self.completion_template, row, where, "task.completion_template", answer=answers[0])
        return Example(prompt, (completion + self.stop,), (0,), tuple(answers))

    def _chat_turns(self, messages: Any, where: str, field: str) -> tuple[str, str]:
        """A chat's prompt (every message before the last, rendered by the tokenizer's chat template
        with the assistant's turn opened) and its completion (the last message, the assistant's)."""
        if (not isinstance(messages, (list, tuple)) or not messages or not isinstance(messages[-1], dict)
                or messages[-1].get("role") != "assistant"):
            raise DataError(f"{where}: {field!r} must be a list of chat messages ending with the "
                            "assistant's ({'role': 'assistant', 'content': ...}), the completion to learn")
        return self.chat(list(messages[:-1])), str(messages[-1].get("content", ""))

    def _class(self, row: dict[str, Any], where: str) -> int:
        if "_label" in row:
            return int(row["_label"])
        raw = row.get(self.label_field)
        n = len(self.label_words)
        if self.labels is not None:
            if _norm(raw) not in self.labels:
                raise DataError(f"{where} has label {raw!r}, which is not in task.labels={list(self.labels)}; add it "
                                "(in the order of task.label_words) or fix the record")
            return self.labels.index(_norm(raw))
        if isinstance(raw, bool) or not str(raw).strip().lstrip("-").isdigit():
            raise DataError(f"{where} has label {raw!r}, not a class index; set task.labels to the label values in the "
                            f"order of task.label_words (e.g. task.labels=[negative,positive])")
        index = int(str(raw).strip())
        if not 0 <= index < n:
            raise DataError(f"{where} has label {index}, but task.label_words has {n} words (classes 0..{n - 1}); "
                            "add a label word for every class")
        return index

    def _choices(self, row: dict[str, Any], where: str) -> tuple[list[str], tuple[int, ...]]:
        if "_candidates" in row:
            raw, gold_raw = list(row["_candidates"]), row["_gold"]
        else:
            if self.candidates_field:
                raw = row.get(self.candidates_field)
                if not isinstance(raw, (list, tuple)):
                    raise DataError(f"{where} has no list of candidates in field {self.candidates_field!r}; set "
                                    "task.candidates_field to a field holding a list, or task.candidate_fields to "
                                    "the fields that each hold one candidate")
            else:
                missing = [f for f in self.candidate_fields if f not in row]
                if missing or not self.candidate_fields:
                    raise DataError(f"{where} lacks the candidate field(s) {missing or '(none configured)'}; set "
                                    "task.candidate_fields (or task.candidates_field) to fields the records have")
                raw = [row[f] for f in self.candidate_fields]
            gold_raw = row.get(self.label_field)
        raw = [str(c) for c in raw]
        if len(raw) < 2:
            raise DataError(f"{where} has {len(raw)} candidate(s); multiple choice needs at least two")
        gold = self._gold(gold_raw, raw, where)
        candidates = [self._format(self.candidate_template, row, where, "task.candidate_template", candidate=c)
                      for c in raw]
        return candidates, gold

    def _gold(self, value: Any, candidates: list[str], where: str) -> tuple[int, ...]:
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
            raise DataError(f"{where} names no right answer; give {self.label_field!r} an index or a candidate's text")
        return tuple(dict.fromkeys(gold))


def _answer_list(value: Any) -> list[str]:
    """Accepted answers from a field: a string, a list of strings, or SQuAD's {"text": [...]}."""
    if isinstance(value, dict):
        value = value.get("text", [])
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value if str(v).strip()]
    return [] if value is None else [str(value)]
