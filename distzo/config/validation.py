"""Checks of a composed configuration that its types cannot express, before anything loads.

Every number of the configuration is checked: floats must be finite (NaN and infinity pass every
comparison they are not meant to), and each key has its range. Files the run will read are checked
for existence and readability, with one line naming the path and the fix. Raises `ConfigError`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf

from ..errors import ConfigError
from ..parallel.shape import MeshError, MeshShape, launched_world_size

# key -> its bound: "> 0", ">= 0" or ">= 1". Every numeric key of the schema is listed (a test checks
# that); `seed` has a range of its own.
RANGES: dict[str, str] = {
    "model.init_seed": ">= 0",
    "task.val_size": "> 0", "task.test_size": "> 0", "task.train_size": "> 0", "task.split_seed": ">= 0",
    "task.max_length": "> 0", "task.num_examples": "> 0", "task.demos": ">= 0",
    "task.max_new_tokens": "> 0",
    "estimator.eps": "> 0", "estimator.q": ">= 1", "estimator.agzo.rank": ">= 1", "estimator.agzo.power_iters": ">= 0",
    "peft.r": "> 0", "peft.alpha": "> 0", "peft.prefix_tokens": "> 0", "peft.init_seed": ">= 0",
    "offload.slots": ">= 1",
    "checkpoint.every": ">= 0", "checkpoint.keep": "> 0",
    "engine.row_tokens": "> 0",
    "bench.warmup": "> 0", "bench.steps": "> 0",  # the training peak is taken over the warm-up steps
    "sweep.nodes": "> 0", "sweep.progress_every_s": "> 0",
    "optim.lr": ">= 0", "optim.weight_decay": ">= 0", "optim.warmup_steps": ">= 0",
    "steps": ">= 0", "batch_size": "> 0", "micro_batch_size": "> 0", "eval_every": ">= 0", "eval_batch_size": "> 0", "log_every": "> 0",
    "threads": "> 0", "replica_check_every": ">= 0", "dist_timeout_s": "> 0", "max_nonfinite_steps": "> 0",
}
SWITCHES = ("engine.fuse_update", "engine.divide_work", "engine.native", "bench.single_rank")
SWITCH_VALUES = ("auto", "true", "false")
COMPUTE_MODES = ("fp32", "tf32", "bf16")
ENCODER_ONLY = ("bert", "roberta", "deberta", "deberta-v2", "distilbert", "electra", "albert", "xlm-roberta",
                "t5", "mt5", "bart", "mbart", "pegasus", "marian", "whisper", "vit")


def _numbers(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every number in a config tree (bools excluded)."""
    if isinstance(node, DictConfig):
        for key in node:
            if key == "hydra":
                continue
            try:
                value = node[key]
            except Exception:  # a value that needs Hydra's runtime to resolve (${now:...})
                continue
            yield from _numbers(value, f"{prefix}{key}.")
    elif isinstance(node, ListConfig):
        for i, value in enumerate(node):
            yield from _numbers(value, f"{prefix}{i}.")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield prefix[:-1], node


def check_numbers(cfg: Any) -> None:
    """Every float finite; every key of RANGES within its range."""
    for key, value in _numbers(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number; give a finite value")
    for key, bound in RANGES.items():
        value = OmegaConf.select(cfg, key)
        if value is None:
            continue
        ok = value > 0 if bound == "> 0" else value >= (0 if bound == ">= 0" else 1)
        if not ok:
            raise ConfigError(f"{key}={value} is out of range; it must be {bound}")
    if cfg.seed is not None and not 0 <= cfg.seed < 2**63:
        raise ConfigError(f"seed={cfg.seed} is out of range; use 0 <= seed < 2**63, or seed=null to draw one")


def _readable_dir(path: str, key: str, what: str) -> Path:
    folder = Path(os.path.expanduser(path))
    if not folder.is_dir():
        raise ConfigError(f"{key}={path!r} does not exist or is not a folder; pass the folder of {what}")
    if not os.access(folder, os.R_OK | os.X_OK):
        raise ConfigError(f"{key}={path!r} is not readable by this user; fix its permissions or copy it elsewhere")
    return folder


def check_local_model(path: str) -> None:
    """A transformers causal-LM folder: config.json readable and valid, a causal-LM architecture,
    weights present."""
    folder = _readable_dir(path, "model.path", "a local transformers causal LM (config.json plus weights)")
    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"model.path={path!r} has no config.json; it must be a transformers model folder "
                          "(as written by save_pretrained)")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"model.path={path!r}: cannot read config.json ({exc}); it must be the JSON that "
                          "save_pretrained writes") from None
    if model_type in ENCODER_ONLY:
        raise ConfigError(f"model.path={path!r} holds a {model_type!r} model, which is not a decoder-only causal LM; "
                          "distzo fine-tunes AutoModelForCausalLM models")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"model.path={path!r} holds a {model_type!r} model, which this transformers release has "
                          "no causal-LM class for (AutoModelForCausalLM); upgrade transformers, or convert the "
                          "model to a supported architecture")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ConfigError(f"model.path={path!r} has no weights (*.safetensors or *.bin); save the model with "
                          "save_pretrained into that folder")
    from ..models.loading import check_weight_files

    check_weight_files(folder)


def _format_string(template: str, key: str) -> list[str]:
    from ..data.examples import template_fields

    try:
        return template_fields(template)
    except ValueError as exc:
        raise ConfigError(f"{key}={template!r} is not a valid format string ({exc}); write fields as {{name}} and a "
                          "literal brace as {{ or }}") from None


def check_task(t: Any) -> None:
    """The task's settings, before its data is read (what the data itself must hold is checked as it
    is read, by distzo.data, with the file and record named)."""
    from ..data.bundled import BUNDLED
    from ..data.presets import READERS

    known = (*BUNDLED, "file", *READERS)
    if t.dataset not in known:
        raise ConfigError(f"task.dataset={t.dataset!r} is unknown; use one of: {', '.join(known)}")
    if t.dataset == "trivia":
        if t.path and not Path(str(t.path)).expanduser().is_dir():
            raise ConfigError(f"task.path={t.path!r} is not a folder of trivia lists; leave it unset to read the "
                              "installed red-discordbot wheel's lists")
    elif t.dataset not in BUNDLED:
        if not t.path:
            raise ConfigError(f"task={t.name} reads local files: add task.path=/path/to/the/data (a file, a folder of "
                              "split files, or a datasets export; docs/tasks.md)")
        if not Path(str(t.path)).expanduser().exists():
            raise ConfigError(f"task.path={t.path!r} does not exist; give a data file (.jsonl, .csv, .tsv, .parquet) "
                              "or a folder of split files or of a datasets export (save_to_disk)")
    elif t.path:
        raise ConfigError(f"task.path={t.path!r} is not read by the bundled {t.dataset} set; use task=custom "
                          f"task.path={t.path} for your own file")
    _format_string(t.template, "task.template")
    if t.kind == "generation":
        if t.dataset in BUNDLED:
            raise ConfigError(f"task.kind=generation needs data with answers; the bundled {t.dataset} set has "
                              "none (use task=custom task.path=... or a generation preset)")
        if "answer" not in _format_string(t.completion_template, "task.completion_template"):
            raise ConfigError(f"task.completion_template={t.completion_template!r} must contain {{answer}}")
    elif t.kind == "classification":
        words = list(t.label_words)
        if len(words) < 2:
            raise ConfigError("task.label_words needs at least two label words (one per class)")
        if len(set(words)) != len(words):
            raise ConfigError(f"task.label_words={words} repeats a word; give one distinct word per class")
        if t.labels is not None and (len(t.labels) != len(words) or len(set(map(str, t.labels))) != len(words)):
            raise ConfigError(f"task.labels={list(t.labels)} must name {len(words)} distinct label values, one per "
                              f"label word of task.label_words={words}, in the same order")
    else:
        if "candidate" not in _format_string(t.candidate_template, "task.candidate_template"):
            raise ConfigError(f"task.candidate_template={t.candidate_template!r} must contain {{candidate}}")
        if t.dataset in ("file",) and not t.candidates_field and not t.candidate_fields:
            raise ConfigError("task.kind=multiple_choice needs the record's candidates: task.candidates_field=<a list "
                              "field> or task.candidate_fields=[<one field per candidate>, ...]")
    if t.kind != "generation" and t.messages_field:
        raise ConfigError("task.messages_field (a chat) is read by task.kind=generation only; add task.kind=generation")
    if t.kind != "multiple_choice" and (t.candidates_field or t.candidate_fields):
        raise ConfigError("task.candidates_field / task.candidate_fields are read by task.kind=multiple_choice only; "
                          "add task.kind=multiple_choice, or use task.label_words for classification")


def validate(cfg: Any, check_world: bool = True) -> None:
    """Check a composed config before any model or data is loaded. Raises ConfigError.
    check_world=False skips the mesh-vs-processes check (for commands that start no mesh)."""
    check_numbers(cfg)
    for key in SWITCHES:
        value = str(OmegaConf.select(cfg, key)).lower()
        if value not in SWITCH_VALUES:
            raise ConfigError(f"{key}={value!r} is not supported; use one of: {', '.join(SWITCH_VALUES)}")

    m = cfg.model
    if m.tokenizer not in (None, "smollm2"):
        _readable_dir(str(m.tokenizer), "model.tokenizer", "a tokenizer (tokenizer.json or its vocabulary files), "
                      "or 'smollm2'")
    if m.path and m.source != "local":
        raise ConfigError(f"model.path={m.path!r} is only read by model=hf (a local folder); the {m.name} preset "
                          f"ignores it. Use model=hf model.path={m.path}")
    if str(m.source).endswith("-wheel"):
        from ..models.assets import check_installed

        check_installed(str(m.source))
    if m.source == "local":
        if not m.path:
            raise ConfigError("model=hf needs a folder: add model.path=/path/to/a/transformers/model")
        check_local_model(str(m.path))
    if m.source == "random":
        import torch

        from ..models.loading import random_model

        # Built on the meta device (no memory, instant): shape errors surface here, not mid-run.
        random_model(str(m.arch), 1024, dict(m.arch_config), 0, getattr(torch, str(m.dtype)), device="meta")

    check_task(cfg.task)
    generation = cfg.task.kind == "generation"
    if cfg.objective in ("f1", "exact_match") and not generation:
        raise ConfigError(f"objective={cfg.objective} scores generated answers; task {cfg.task.name} is "
                          f"{cfg.task.kind}: use objective=loss or objective=accuracy")
    if cfg.objective in ("f1", "exact_match") and cfg.estimator.name != "mezo":
        raise ConfigError(f"objective={cfg.objective} decodes answers under each of MeZO's perturbations; "
                          f"estimator={cfg.estimator.name} is not supported with it: use estimator=mezo")
    if cfg.objective == "accuracy" and generation:
        raise ConfigError(f"objective=accuracy compares candidates; task {cfg.task.name} generates answers: use "
                          "objective=loss, objective=exact_match or objective=f1")

    e = cfg.estimator
    pe = cfg.peft
    if pe.method in ("lora", "lora_fa") and not pe.targets:
        raise ConfigError(f"peft={pe.method} needs at least one target layer name in peft.targets (e.g. [q_proj,v_proj])")
    if e.name == "prge" and pe.method != "lora_fa":
        raise ConfigError(f"estimator=prge perturbs LoRA-FA's B matrices only; add peft=lora_fa (now peft={pe.method})")
    if e.name == "prge" and e.difference != "central":
        raise ConfigError("estimator=prge evaluates + and - of every query in one forward; it needs "
                          "estimator.difference=central")
    if e.name == "agzo" and e.difference != "forward":
        raise ConfigError("estimator=agzo is one-sided (AGZO Algorithm 2); it needs estimator.difference=forward")
    if e.name == "agzo" and e.distribution != "gaussian":
        raise ConfigError("estimator=agzo draws Gaussian R and dense noise; it needs estimator.distribution=gaussian")

    off = cfg.offload
    if str(cfg.engine.compute) not in COMPUTE_MODES:
        raise ConfigError(f"engine.compute={cfg.engine.compute} is not a compute mode; use one of "
                          f"{', '.join(COMPUTE_MODES)}")
    if off.transfer_dtype is not None and off.mode == "none":
        raise ConfigError("offload.transfer_dtype only applies to offloaded blocks; add offload=cpu")
    if off.mode != "none" and (e.name != "mezo" or pe.method != "none"):
        what = f"estimator={e.name}" if e.name != "mezo" else f"peft={pe.method}"
        raise ConfigError(f"offload={off.mode} streams full-parameter blocks for estimator=mezo only; {what} "
                          "is not supported with offloading yet: use offload=none")

    try:
        shape = MeshShape.parse(cfg.mesh)
        if check_world:
            shape.check_world(launched_world_size())
    except MeshError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.batch_size < shape.data:
        raise ConfigError(f"batch_size={cfg.batch_size} is smaller than the data-parallel degree D={shape.data} "
                          f"of mesh={cfg.mesh}; every data rank needs at least one example")
