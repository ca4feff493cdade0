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
`candidate_template`. A preset may first rewrite a record (`distzo.data.readers`): it returns the
fields the template reads plus `_label` (a class index) or `_candidates` and `_gold`. How each kind
reads its answer is its class's, in `distzo.data.kinds`.

Generation reads the record layouts SFT data comes in without settings (`Generation.layout`): the
configured `answers_field` under `template`; else `prompt` and `completion` fields (TRL's
prompt-completion format, plain or conversational); a chat `messages` list (the last message, the
assistant's, is the completion); or a `text` field (language modelling on the whole text).

Every mistake names the file, the record and the fix (`DataError`).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..config.schema import TaskConfig
from .records import DataError


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


def norm(value: Any) -> str:
    return str(value).strip().lower()


class RecordFormatter:
    """Turns one split's records into Examples (see the module docstring): the task settings every
    kind reads, the record's fields and templates; what differs by kind is the kind's
    (`distzo.data.kinds`: how a record names its answer and becomes an Example).

    kind: the task kind's class; rewrite: a preset's record rewrite (None: the record's own
    fields); chat: renders a chat's messages as a prompt."""

    def __init__(self, cfg: TaskConfig, kind: Any,
                 rewrite: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
                 chat: Callable[[list[dict[str, Any]]], str] | None = None):
        self.kind = kind
        self.answers_field, self.completion_template, self.stop = cfg.answers_field, cfg.completion_template, cfg.stop
        self.messages_field, self.chat = cfg.messages_field, chat
        self.template = cfg.template
        self.label_field = cfg.label_field
        self.labels = [norm(v) for v in cfg.labels] if cfg.labels else None
        self.label_words = tuple(cfg.label_words)
        self.candidates_field = cfg.candidates_field
        self.candidate_fields = list(cfg.candidate_fields or [])
        self.candidate_template = cfg.candidate_template
        self.rewrite = rewrite
        self.fields = template_fields(self.template)
        self.layout = "template"  # the current split's record layout (the kind's `layout`)

    def has_label(self, record: dict[str, Any]) -> bool:
        """Whether a (rewritten) record says which answer is right (test splits of GLUE and SuperGLUE
        do not)."""
        if "_label" in record or "_gold" in record or "_answers" in record:
            return next(record[k] for k in ("_label", "_gold", "_answers") if k in record) is not None
        return self.kind.has_label(self, record)

    def examples(self, records: Sequence[dict[str, Any]], split: str, origin: str) -> list[Example] | None:
        """The examples of a split; None when no record of it carries a label (an unlabelled test
        split), an error when only some lack one."""
        rows = self.rewrite(list(records)) if self.rewrite else list(records)
        # A file's records share its columns (missing values read as None): the layout is what the
        # split's records carry.
        self.layout = self.kind.layout(self, {k for r in rows for k, v in r.items() if v is not None})
        labelled = [self.has_label(r) for r in rows]
        if rows and not any(labelled):
            return None
        out = []
        for i, (row, ok) in enumerate(zip(rows, labelled)):
            where = f"record {i} of the {split} split of {origin}"
            if not ok:
                field, key = self.kind.answer_key(self)
                raise DataError(f"{where} has no {field!r} (the answer), though other records do; "
                                f"give every record its answer, or set {key} to the field that holds it")
            out.append(self.kind.example(self, row, where))
        return out

    def format(self, template: str, row: dict[str, Any], where: str, key: str, **extra: Any) -> str:
        """`template` filled from the record's fields (and `extra`); the mistakes name the setting `key`.
        A field the template reads that a record lacks or holds null in (a file's records share its
        columns, so a missing one reads as None) is refused: it would be trained on as the text "None"."""
        empty = next((name for name in template_fields(template) if name not in extra and name in row
                      and row[name] is None), None)
        if empty is not None:
            raise DataError(f"{where} has no value for the field {empty!r} (missing or null), which {key}={template!r} "
                            f"reads; give every record its {empty!r}, or remove that record")
        try:
            return template.format(**{**row, **extra})
        except KeyError as exc:
            fields = sorted(k for k in row if not k.startswith("_"))
            raise DataError(f"{key}={template!r} reads the field {exc.args[0]!r}, but {where} has only {fields}; "
                            f"use those names in {key}") from None
        except (IndexError, ValueError) as exc:
            raise DataError(f"{key}={template!r} is not a valid format string ({exc}); write fields as {{name}} "
                            "and a literal brace as {{ or }}") from None


def answer_list(value: Any) -> list[str]:
    """Accepted answers from a field: a string, a list of strings, or SQuAD's {"text": [...]}."""
    if isinstance(value, dict):
        value = value.get("text", [])
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value if str(v).strip()]
    return [] if value is None else [str(value)]
