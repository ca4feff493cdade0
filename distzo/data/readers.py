"""The task suite of the ZO papers (MeZO Table 14): readers that turn the public copies of SST-2,
RTE, CB, BoolQ, WSC, WiC, MultiRC, COPA and ReCoRD into the fields their templates read.

Each reader accepts the formats these sets are distributed in (SuperGLUE's JSONL, GLUE's TSV) and
the Hugging Face `datasets` exports of `glue` / `super_glue` (`save_to_disk`), whose fields and label
encodings differ; it returns one record per example with the template's fields and `_label` (a
class index, None when the split has no answers) or `_candidates` and `_gold` (multiple choice).
MultiRC and ReCoRD are nested in SuperGLUE's files (one passage, many questions) and are flattened
here, one example per (question, answer) or per query.

The templates and verbalizers themselves live in `conf/task/<name>.yaml`, so they can be read and
overridden like any other setting. What cannot be written as a format string is done here: BoolQ's
question gets a capital and a question mark, WSC's pronoun is lower-cased, COPA's premise loses its
full stop and gains "so" or "because" and its choices start in lower case (except "I"), ReCoRD's
highlights become dashes and each candidate is the query with the entity in its placeholder.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from .records import DataError

log = logging.getLogger("distzo")

Records = list[dict[str, Any]]


def _label(record: dict[str, Any], mapping: dict[Any, int], task: str) -> int | None:
    """The class of a record's `label` through `mapping` (strings compared in lower case); None when
    the record has no label (a test split)."""
    raw = record.get("label")
    if raw is None or (isinstance(raw, int) and not isinstance(raw, bool) and raw < 0):
        return None  # absent, or -1: how the datasets exports mark an unlabelled test split
    key = raw.strip().lower() if isinstance(raw, str) else raw
    if isinstance(key, str) and key.lstrip("-").isdigit():
        key = int(key)
    if key not in mapping:
        raise DataError(f"task={task}: label {raw!r} is not one of {sorted({str(k) for k in mapping})}; is task.path "
                        f"a copy of {task.upper()}?")
    return mapping[key]


def _field(record: dict[str, Any], task: str, *names: str) -> Any:
    """The first of `names` the record has (the distributions name some fields differently)."""
    for name in names:
        if name in record and record[name] is not None:
            return record[name]
    have = sorted(record)
    raise DataError(f"task={task}: a record has none of the fields {list(names)} (it has {have}); is task.path a copy "
                    f"of {task.upper()} in SuperGLUE's JSONL, GLUE's TSV or a datasets export?")


YES_NO = {True: 1, False: 0, "true": 1, "false": 0}  # candidates [No, Yes]; 1 and 0 hash as True and False


def sst2(records: Records) -> Records:
    return [{"sentence": str(_field(r, "sst2", "sentence")).strip(), "_label": _label(r, {0: 0, 1: 1}, "sst2")}
            for r in records]


ENTAILMENT = {"entailment": 0, "not_entailment": 1, 0: 0, 1: 1}  # candidates [Yes, No]


def rte(records: Records) -> Records:
    return [{"premise": _field(r, "rte", "premise", "sentence1"),
             "hypothesis": _field(r, "rte", "hypothesis", "sentence2"),
             "_label": _label(r, ENTAILMENT, "rte")} for r in records]


def cb(records: Records) -> Records:
    mapping = {"entailment": 0, "contradiction": 1, "neutral": 2, 0: 0, 1: 1, 2: 2}  # [Yes, No, Maybe]
    return [{"premise": _field(r, "cb", "premise"), "hypothesis": _field(r, "cb", "hypothesis"),
             "_label": _label(r, mapping, "cb")} for r in records]


def boolq(records: Records) -> Records:
    out = []
    for r in records:
        question = str(_field(r, "boolq", "question")).strip()
        question = question[:1].upper() + question[1:]
        if not question.endswith("?"):
            question += "?"
        labelled = r if "label" in r else {"label": r.get("answer")}  # google/boolq (MeZO's copy) calls it answer
        out.append({"passage": _field(r, "boolq", "passage"), "question": question,
                    "_label": _label(labelled, YES_NO, "boolq")})
    return out


def wsc(records: Records) -> Records:
    out = []
    for r in records:
        target = r.get("target") or r  # SuperGLUE nests the spans under "target"; the export does not
        out.append({"text": _field(r, "wsc", "text"), "span1": _field(target, "wsc", "span1_text"),
                    "span2": str(_field(target, "wsc", "span2_text")).lower(), "_label": _label(r, YES_NO, "wsc")})
    return out


def wic(records: Records) -> Records:
    return [{"word": _field(r, "wic", "word"), "sentence1": _field(r, "wic", "sentence1"),
             "sentence2": _field(r, "wic", "sentence2"), "_label": _label(r, YES_NO, "wic")} for r in records]


def multirc(records: Records) -> Records:
    out = []
    for r in records:
        if "paragraph" in r:  # the datasets export: one record per (question, answer) already
            out.append({"paragraph": r["paragraph"], "question": _field(r, "multirc", "question"),
                        "answer": _field(r, "multirc", "answer"), "_label": _label(r, YES_NO, "multirc")})
            continue
        passage = _field(r, "multirc", "passage")
        for q in passage.get("questions") or []:
            for a in q.get("answers") or []:
                out.append({"paragraph": passage["text"], "question": q["question"], "answer": a["text"],
                            "_label": _label(a, YES_NO, "multirc")})
    return out


def _copa_choice(text: str) -> str:
    words = str(text).strip().split(" ")
    if words[0] != "I":
        words[0] = words[0].lower()
    return " ".join(words)


def copa(records: Records) -> Records:
    out = []
    for r in records:
        premise = str(_field(r, "copa", "premise")).rstrip()
        if premise.endswith("."):
            premise = premise[:-1]
        question = _field(r, "copa", "question")
        if question not in ("cause", "effect"):
            raise DataError(f"task=copa: question {question!r} is neither 'cause' nor 'effect'")
        gold = _label(r, {0: 0, 1: 1}, "copa")
        out.append({"premise": premise, "connector": " because" if question == "cause" else " so",
                    "_candidates": [_copa_choice(_field(r, "copa", "choice1")),
                                    _copa_choice(_field(r, "copa", "choice2"))],
                    "_gold": None if gold is None else [gold]})
    return out


def _record_query(passage: str, query: str, entities: list[str], answers: list[str] | None) -> dict[str, Any]:
    entities = list(dict.fromkeys(e for e in entities if e))  # first-occurrence order, once each
    gold = None
    if answers is not None:
        gold = [entities.index(a) for a in dict.fromkeys(answers) if a in entities]
        if not gold:  # an answer no entity span covers: score it as a candidate of its own
            entities.append(answers[0])
            gold = [len(entities) - 1]
    return {"passage": passage.replace("@highlight\n", "- "),
            "_candidates": [query.replace("@placeholder", e) for e in entities], "_gold": gold}


def record(records: Records) -> Records:
    out = []
    for r in records:
        if "qas" in r:  # SuperGLUE: a passage with entity spans (inclusive ends) and its queries
            text = r["passage"]["text"]
            entities = [text[e["start"]:e["end"] + 1] for e in r["passage"].get("entities") or []]
            for q in r["qas"]:
                answers = [a["text"] for a in q["answers"]] if q.get("answers") else None
                out.append(_record_query(text, q["query"], entities, answers))
        else:  # the datasets export: one record per query, entities and answers as strings
            answers = list(r["answers"]) if r.get("answers") else None
            out.append(_record_query(_field(r, "record", "passage"), _field(r, "record", "query"),
                                     list(_field(r, "record", "entities")), answers))
    return out


READERS: dict[str, Callable[[Records], Records]] = {
    "sst2": sst2, "rte": rte, "cb": cb, "boolq": boolq, "wsc": wsc, "wic": wic, "multirc": multirc, "copa": copa,
    "record": record,
}


# --- question answering (generation) -----------------------------------------------------------------

def squad_json(obj: dict[str, Any]) -> Records:
    """SQuAD's distributed file (train-v1.1.json, dev-v1.1.json): one object whose `data` lists articles."""
    return list(obj["data"])


def squad(records: Records) -> Records:
    out = []
    for r in records:
        if "paragraphs" in r:  # an article of the distributed file: paragraphs and their questions
            for p in r["paragraphs"]:
                for qa in p["qas"]:
                    out.append({"title": r.get("title", ""), "context": p["context"],
                                "question": qa["question"].strip(),
                                "_answers": [a["text"] for a in qa.get("answers") or []] or None})
        else:  # the datasets export: one record per question, answers {"text": [...], "answer_start": [...]}
            answers = (r.get("answers") or {}).get("text") or None
            out.append({"title": r.get("title", ""), "context": _field(r, "squad", "context"),
                        "question": str(_field(r, "squad", "question")).strip(), "_answers": answers})
    return out


def drop_json(obj: dict[str, Any]) -> Records:
    """DROP's distributed file (drop_dataset_train.json, drop_dataset_dev.json): passages by id."""
    return [{"passage_id": k, **v} for k, v in obj.items()]


def _drop_answer_texts(answer: dict[str, Any]) -> list[str]:
    """A DROP answer as text: its number, its date ("day month year", the parts it has), or each span."""
    if str(answer.get("number") or "").strip():
        return [str(answer["number"]).strip()]
    date = answer.get("date") or {}
    parts = [str(date.get(k) or "").strip() for k in ("day", "month", "year")]
    if any(parts):
        return [" ".join(p for p in parts if p)]
    return [str(s).strip() for s in answer.get("spans") or [] if str(s).strip()]


def drop(records: Records) -> Records:
    out = []
    for r in records:
        if "qa_pairs" in r:  # the distributed file: a passage and its questions
            for qa in r["qa_pairs"]:
                answers = _drop_answer_texts(qa.get("answer") or {})
                for extra in qa.get("validated_answers") or []:
                    answers += [a for a in _drop_answer_texts(extra) if a not in answers]
                out.append({"passage": r["passage"], "question": qa["question"].strip(), "_answers": answers or None})
        else:  # the datasets export: answers_spans {"spans": [...], "types": [...]}
            spans = [s for s in (r.get("answers_spans") or {}).get("spans") or [] if str(s).strip()]
            out.append({"passage": _field(r, "drop", "passage"), "question": str(_field(r, "drop", "question")).strip(),
                        "_answers": spans or None})
    return out


def trivia(records: Records) -> Records:
    """Trivia lists (question -> accepted answers), already one record per question (`trivia_records`)."""
    return [{"question": r["question"], "list": r["list"], "_answers": r["answers"]} for r in records]


READERS.update({"squad": squad, "drop": drop, "trivia": trivia})

# Distributed files that are one JSON object rather than records (read without `datasets`).
JSON_OBJECTS: dict[str, Callable[[dict[str, Any]], Records]] = {"squad": squad_json, "drop": drop_json}
