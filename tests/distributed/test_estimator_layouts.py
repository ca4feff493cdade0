"""Each estimator is layout invariant (I2, docs/architecture.md#invariants): the same run on 1x1, 2x2
and 4x1 ends with the same weights, within the tolerance tests/distributed/test_mesh.py states for
data-parallel layouts.

To stay cheap, one set of four gloo processes (start_ranks) trains every estimator on
both four-rank meshes in turn, each on a fresh process group; the 1x1 references run in the test
process. The runs: MeZO n-SPSA (q=2: four evaluations, one per rank on 4x1), P-RGE on LoRA-FA (q=2,
each rank's evaluations in one batched forward) and AGZO (q=3 perturbed evaluations over the 4x1
mesh, one rank idle; every rank derives the bases from the shared clean forward). Beside them,
MeZO on models driven other ways (docs/models.md), 1x1 against 2x2: random GPT-2, Gemma 3,
GPT-NeoX (also with LoRA), Phi-3, Falcon and StableLM on the general path, and the tiny Llama on
the whole-model fallback; LoRA and P-RGE's LoRA-FA on an int8 and an int4 (NF4) quantized base;
LOZO, LOZO-M, SubZero and Sparse MeZO; the optimizers, HiZOO's Hessian-shaped directions included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.launch import hosted_store, set_rank_env, start_ranks
from tests.plugins import signum  # noqa: F401  registers optim.name=signum here and in the ranks

STEPS = 5
COMMON = ["model=tiny", "eval_every=0", "log_every=1000", f"steps={STEPS}", "batch_size=12", "seed=3",
          "task.val_size=12", "task.test_size=12", "threads=1", "checkpoint.every=0"]
CUE = ["task=synthetic-cue"]
RUNS = {
    "mezo": [*CUE, "estimator=mezo", "estimator.q=2", "optim.lr=1e-3"],
    "prge": [*CUE, "estimator=prge", "peft=lora_fa", "estimator.q=2", "optim.lr=0.5"],
    "agzo": [*CUE, "estimator=agzo", "estimator.q=3", "estimator.eps=1e-3", "optim.lr=2e-3"],
    # multiple choice: four candidates after each shared prompt (branches), scored by likelihood
    "choice": ["task=mr-endings", "task.train_size=64", "task.loss=classification", "estimator=mezo", "estimator.q=2",
               "optim.lr=1e-3"],
    # generation: teacher forcing on completions, and F1 of answers decoded under each perturbation
    # (float64, so that no argmax between nearly equal logits depends on the layout's matmul shapes)
    "sft": ["{qa}", "estimator=mezo", "estimator.q=2", "optim.lr=3e-4"],
    "f1": ["{qa}", "objective=f1", "model.dtype=float64", "estimator=mezo", "estimator.q=2", "estimator.eps=3e-2",
           "optim.lr=3e-2"],
    # families on the general path (distzo.models.generic), random configs
    "gpt2": [*CUE, "model.arch=gpt2", "estimator=mezo", "estimator.q=2", "optim.lr=1e-3"],
    "gemma3": [*CUE, "model.arch=gemma3_text", "estimator=mezo", "estimator.q=2", "optim.lr=1e-3"],
    "gpt_neox": [*CUE, "model.arch=gpt_neox", "estimator=mezo", "estimator.q=2", "optim.lr=1e-3"],
    "phi3": [*CUE, "model.arch=phi3", "estimator=mezo", "estimator.q=2", "optim.lr=1e-3"],
    "falcon": [*CUE, "model.arch=falcon", "estimator=mezo", "estimator.q=2", "optim.lr=1e-3"],
    "stablelm": [*CUE, "model.arch=stablelm", "estimator=mezo", "estimator.q=2", "optim.lr=1e-3"],
    # LoRA through the general path: hooks on GPT-NeoX's fused query_key_value projections
    "lora-neox": [*CUE, "model.arch=gpt_neox", "peft=lora", "peft.targets=[query_key_value]", "estimator=mezo",
                  "estimator.q=2", "optim.lr=1e-2", "estimator.eps=1e-2"],
    # the whole-model fallback (the stock forward as one stage), forced on the tiny Llama
    "whole": [*CUE, "model.adapter=whole", "estimator=mezo", "estimator.q=2", "optim.lr=1e-3"],
    # the optimizers (docs/optimizers.md): on 2x2 and 4x1 the node's ranks share the master and the
    # state (work division); FZOO's one-sided plan of 4 probes puts one on each rank of 4x1
    "momentum": [*CUE, "estimator=mezo", "estimator.q=2", "optim.name=momentum", "optim.lr=2e-4",
                 "optim.weight_decay=0.1"],
    "adam": [*CUE, "estimator=mezo", "estimator.q=2", "optim.name=adam", "optim.lr=1e-3", "optim.weight_decay=0.1"],
    "sign": [*CUE, "estimator=mezo", "estimator.q=2", "optim.name=sign", "optim.lr=1e-3"],
    "fzoo": [*CUE, "estimator=mezo", "estimator.q=3", "estimator.difference=forward",
             "estimator.distribution=rademacher", "optim.name=fzoo", "optim.lr=1e-3"],
    # HiZOO: a state that shapes the directions (every copy reads the Hessian), three probes a step (4x1: one
    # rank idle); alpha large enough that H moves by several percent a step here
    "hizoo": [*CUE, "estimator=mezo", "estimator.clean=true", "optim.name=hizoo", "optim.alpha=1e-4",
              "optim.lr=1e-3", "optim.weight_decay=0.1"],
    # MEAZO: coefficients normalised by a running number every rank keeps alike (from the exchanged losses)
    "meazo": [*CUE, "estimator=mezo", "estimator.q=2", "optim.name=meazo", "optim.beta2=0.9", "optim.lr=1e-3"],
    # an optimizer added in one file (tests/plugins/signum.py, imported above): stateful, torch ops only
    "signum": [*CUE, "estimator=mezo", "estimator.q=2", "optim.name=signum", "optim.lr=1e-3"],
    # an optimizer with state on a trainable set of its own: LoRA-FA's B under P-RGE's batched forward
    "prge-adam": [*CUE, "estimator=prge", "peft=lora_fa", "estimator.q=2", "optim.name=adam", "optim.lr=1e-2"],
    # adapters on a quantized frozen base (distzo.models.quantize): torchao's int8 and NF4 weights
    "lora-int8": [*CUE, "peft=lora", "model.quantize=int8", "estimator=mezo", "estimator.q=2", "optim.lr=1e-2",
                  "estimator.eps=1e-2"],
    "lora-int4": [*CUE, "peft=lora", "model.quantize=int4", "estimator=mezo", "estimator.q=2", "optim.lr=1e-2",
                  "estimator.eps=1e-2"],
    "prge-int4": [*CUE, "estimator=prge", "peft=lora_fa", "model.quantize=int4", "estimator.q=2", "optim.lr=0.5"],
    # structured directions (docs/estimators.md): low-rank factors (V renewed every 2 steps of the 5),
    # LOZO-M's momentum of the factor, SubZero's subspaces, Sparse MeZO's magnitude mask (thresholds
    # re-derived from the weights every 2 steps)
    "lozo": [*CUE, "estimator=lozo", "estimator.q=2", "estimator.lazy_interval=2", "optim.lr=1e-3"],
    "lozo-m": [*CUE, "estimator=lozo", "estimator.q=2", "estimator.lazy_interval=2", "estimator.factor_momentum=0.9",
               "optim.lr=1e-3"],
    "subzero": [*CUE, "estimator=subzero", "estimator.q=2", "estimator.rank=4", "estimator.subspace_interval=2",
                "optim.lr=1e-3"],
    # lr 1e-3: an element whose mask flips on the shards' rounding takes or misses a whole update; at 1e-2 that
    # is the weights' own scale, and it moved the next losses by ~1e-3 relative, so every later update
    # differed (26% of the elements off at seed 3); at 1e-3 the flips stay local (0-3 elements, seeds 3-5)
    "sparse": [*CUE, "estimator=sparse_mezo", "estimator.q=2", "estimator.mask_interval=2", "optim.lr=1e-3"],
    # the structured directions under a stateful optimizer (docs/optimizers.md#what-composes-with-what):
    # the state follows the structured direction's update, shared by a node's ranks. Momentum, a
    # continuous rule: Adam's sign-like first steps flip the elements whose estimate is within the
    # shards' rounding of zero (the "adam" entry's bound), and with SubZero's small first estimates
    # (g 0.13 against MeZO's 4.4 here) that rounding is 30x larger relative to them, so the flips, and
    # the trajectories they change, outgrow that bound though nothing differs but rounding.
    "lozo-momentum": [*CUE, "estimator=lozo", "estimator.q=2", "estimator.lazy_interval=2", "optim.name=momentum",
                      "optim.lr=2e-4", "optim.weight_decay=0.1"],
    "subzero-momentum": [*CUE, "estimator=subzero", "estimator.q=2", "estimator.rank=4",
                         "estimator.subspace_interval=2", "optim.name=momentum", "optim.lr=2e-4"],
    "sparse-momentum": [*CUE, "estimator=sparse_mezo", "estimator.q=2", "estimator.mask_interval=2",
                        "optim.name=momentum", "optim.lr=1e-3"],
}
QA = ["task=custom", "task.kind=generation", "task.template='Q: {question} A:'", "task.max_new_tokens=3"]
MESHES = ["2x2", "4x1"]
# 1x1 against 2x2 only: the general path's and the fallback's runs, and the task kinds (choice, sft),
# whose data-parallel and perturbation-parallel halves 2x2 already exercises; 4x1 stays for the
# estimators, whose evaluations it deals one per rank
ONLY_2X2 = {"gpt2", "gemma3", "gpt_neox", "phi3", "falcon", "stablelm", "lora-neox", "whole", "choice", "sft",
            "prge-adam", "meazo"}
# optimizers whose update is discontinuous where the estimate is zero, and their lr (see the test)
SIGN_LIKE = {"adam": 1e-3, "sign": 1e-3, "signum": 1e-3}
MASKED = {"sparse", "sparse-momentum"}  # directions with a magnitude mask (see the test)
JOBS = [(name, mesh) for name in RUNS for mesh in MESHES if mesh == "2x2" or name not in ONLY_2X2]


def _config(name: str, mesh: str, root: Path):
    """The run's composed and checked configuration: a copy of the one composed at the first call (the
    1x1 reference's is read again by `initial`; a composition costs ~0.2 s of CPU, a copy ~0.02 s)."""
    import copy

    from distzo.config.compose import compose_config
    from distzo.run.checks import validate

    key = (name, mesh, root)
    if key not in _COMPOSED:
        run = [o for r in RUNS[name] for o in ([*QA, f"task.path={root / 'qa.jsonl'}"] if r == "{qa}" else [r])]
        cfg = compose_config(COMMON + run + [f"mesh={mesh}"])
        validate(cfg, check_world=False)  # the mesh's world is checked again where it runs (the library's checks)
        _COMPOSED[key] = cfg
    return copy.deepcopy(_COMPOSED[key])


_COMPOSED: dict = {}


def _train(name: str, mesh: str, root: Path, cfg=None) -> None:
    from distzo.run.training import train

    run_dir = root / f"{name}-{mesh}"
    run_dir.mkdir(parents=True, exist_ok=True)
    train(cfg if cfg is not None else _config(name, mesh, root), run_dir)


def _worker(rank: int, world: int, port: int, root: Path, configs: list) -> None:
    # One store, hosted by the test process, serves every run: each run's keys get a namespace of
    # their own (set_rank_env's job), so each has a fresh rendezvous on a port bound the whole time. The
    # configurations come composed (Hydra's composition costs ~0.3 s of CPU, once here rather than
    # once per rank and run).
    for i, ((name, mesh), cfg) in enumerate(zip(JOBS, configs)):
        set_rank_env(rank, world, port, job=i)
        _train(name, mesh, root, cfg)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    final = run_dir / "final"
    path = final / "adapter.safetensors" if (final / "adapter.safetensors").exists() else final / "model.safetensors"
    return load_file(path)


def write_qa(root: Path) -> None:
    """Questions whose accepted answers are what the initial tiny model itself answers (its greedy
    three tokens), for half of them, and unrelated words for the rest: F1 is then far from 0 and
    moves with the perturbations, so an F1 step has a signal to follow."""
    import json

    from distzo.data.decoding import greedy_decode
    from distzo.models.loading import load_model

    cfg = compose_config_for_model()
    model, tokenizer = load_model(cfg.model)
    words = ["red", "cat", "sun", "tree", "blue", "dog", "rain", "stone", "milk", "fire", "moon", "salt"]
    questions = [f"what is {a} {b}" for a in words for b in words[:6]]
    prompts = [tokenizer(f"Q: {q} A:").input_ids for q in questions]
    answers = greedy_decode(model, tokenizer, prompts, 3, "\n", tokenizer.pad_token_id)
    rows = [{"question": q, "answers": [a if i % 2 == 0 and a else words[i % len(words)]]}
            for i, (q, a) in enumerate(zip(questions, answers))]
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def compose_config_for_model():
    from distzo.config.compose import compose_config

    return compose_config(["model=tiny", "model.dtype=float64"])


# Session-scoped: built once per process even when pytest-xdist interleaves this file's tests with
# other files' (a module fixture would be torn down and built again, minutes each time).
@pytest.fixture(scope="session")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("estimator-layouts")
    write_qa(root)
    store = hosted_store(4, 600)
    configs = [_config(name, mesh, root) for name, mesh in JOBS]
    start_ranks(_worker, 4, (4, store.port, root, configs))
    del store
    threads = torch.get_num_threads()
    try:
        for name in RUNS:
            _train(name, "1x1", root)
    finally:
        torch.set_num_threads(threads)
    weights = {job: final_weights(root / f"{job[0]}-{job[1]}") for job in [*((name, "1x1") for name in RUNS), *JOBS]}
    return weights, root


def initial(name: str, root: Path) -> dict[str, torch.Tensor]:
    from distzo.models.loading import load_model
    from distzo.peft import apply_peft

    cfg = _config(name, "1x1", root)
    model, _ = load_model(cfg.model)
    apply_peft(model, cfg.peft)
    if cfg.peft.method != "none":  # final/ holds the trainable tensors under their parameter names
        return {k: v.detach() for k, v in model.state_dict().items()}
    folder = root / f"{name}-initial"  # final/ holds what save_pretrained writes (its key names)
    model.save_pretrained(folder)
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("name,mesh", JOBS)
def test_estimator_is_layout_invariant(layouts, name, mesh):
    """Shards pack fewer prompts per row, so float32 rounding of the losses (~1e-7 relative) reaches
    the weights through lr * g * z. test_mesh.py's tolerance, 1e-6 absolute against updates of
    ~4e-2, is about 3e-5 of the movement; here the weights must agree to 1e-4 of how far training
    moved them (observed on 2x2: 1.8e-7 for MeZO and 2.4e-7 for AGZO, against moves of 2.5e-2 and
    5.6e-3; 1.8e-6 for P-RGE's B, which its large lr moved by 1.0), and training must have moved
    them by more than 1e-3: a wrong shard, direction, basis or reduction would be off by the size of
    an update.

    Bitwise equality is claimed only where the same operations run on the same shapes: on 4x1 a rank
    runs its evaluations one by one on the whole batch, exactly as 1x1 does, for MeZO (every task,
    objective=f1 included: the same decoded answers) and AGZO. P-RGE batches a rank's evaluations
    into one forward (4 on 1x1, 1 on 4x1), so its matmuls have other shapes there and the CPU's
    kernels may round differently: it is held to the tolerance above. The F1 run decodes in float64
    so that its 2x2 shards (other matmul shapes) decode the same tokens; its F1 values, and so its
    steps, are then those of 1x1 to float64 rounding."""
    weights, root = layouts
    ref, got = weights[(name, "1x1")], weights[(name, mesh)]
    assert ref.keys() == got.keys()
    start = initial(name, root)
    moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)
    diff = max(float((ref[k] - got[k]).abs().max()) for k in ref)
    assert moved > 1e-3, moved
    if name in SIGN_LIKE and mesh == "2x2":
        # Sign and Adam's first steps are discontinuous in the estimate: lr * sign(g_i) (Adam's first
        # step is m/sqrt(v) = g/|g|). The shards' losses round differently (relative ~1e-4 in c_k at
        # eps 1e-3), so an element whose g_i = sum_k c_k z_ki is within that of zero may take the
        # other sign: about that fraction of the elements per step, each off by at most 2 lr a step.
        # Every other element is held to the tolerance above; a wrong shard, direction or reduction
        # would put nearly all of them off.
        off = sum(int(((ref[k] - got[k]).abs() > 1e-4 * moved).sum()) for k in ref)
        assert off <= 1e-3 * sum(t.numel() for t in ref.values()), off
        assert diff <= 2 * SIGN_LIKE[name] * STEPS * (1 + 1e-6), diff
    elif name in MASKED and mesh == "2x2":
        # Sparse MeZO's mask |x| <= h is discontinuous in x: the shards' rounding (~1e-7 relative in
        # c_k, hence ~1e-10 in x) puts an element within that of its threshold on the other side of
        # it, and the re-derived thresholds (an element of the weights) move with such elements. That
        # element then takes or misses whole updates (at most the largest move of any element, twice
        # over); every other element is held to the tolerance above, and a wrong mask, shard or
        # direction would put a large share of them off.
        off = sum(int(((ref[k] - got[k]).abs() > 1e-4 * moved).sum()) for k in ref)
        assert off <= 1e-3 * sum(t.numel() for t in ref.values()), off
        assert diff <= 2 * moved, (diff, moved)
    else:
        assert diff < 1e-4 * moved, (diff, moved)
    if mesh == "4x1" and name != "prge":
        assert diff == 0.0, diff
    if name == "prge":  # only the trainable tensors were saved: LoRA-FA's B matrices
        assert all(k.endswith("lora_B") for k in ref)
    if name == "lora-neox":  # LoRA's A and B on every layer's query_key_value, nothing else
        assert ref and all(k.endswith(("query_key_value.lora_A", "query_key_value.lora_B")) for k in ref)
