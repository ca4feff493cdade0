"""The CUDA paths, run where a GPU is: offloaded = resident bitwise with the slot ring exercised
(streams, events, pinned host masters), every estimator, trainable set and compute mode for a few
steps (LoRA on an int8 and an int4 quantized base among them, resident and streamed), the Triton
draw kernel against the streams' definitions, reduced-precision streaming with the host far ahead
of the GPU, bench on the 1B preset and the table's workload in miniature (float16 OPT at 2,048
tokens), ZOTrainer offloaded against resident. Skipped with one reason on machines without CUDA
(the CPU suite covers the same logic there). Tolerances: bitwise wherever both sides run the same
kernels on the same shapes (offloaded against resident, two ranks against one); the Gaussian stream
within 5e-5 of its float64 definition (the GPU's approximate ln, cos and sin); training runs check
their own bookkeeping, not values. Last run: an H100, BENCHMARKS.md "On a GPU"."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from distzo.run.training import train
from distzo.telemetry.jsonl import read_jsonl
from distzo.zo.directions import Directions, chunks_of, param_key
from distzo.zo.streams import as_int64, stream_signs, stream_words
from tests.conftest import make_config
from tests.distributed.launch import ENV


def run_fresh(nproc: int, argv: list[str], cwd, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python -m distzo ARGV` (torchrun --standalone for nproc > 1) in fresh interpreters: the CPU
    suite forks its ranks from a preloaded server, but a process that has initialised CUDA (this
    one, by the tests before) cannot fork a child that uses it."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    head = [sys.executable, *launcher, "-m", "distzo"]
    return subprocess.run([*head, *argv], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: tests/gpu runs on a machine with a GPU")

FAST = ("device=cuda", "task=synthetic-cue", "eval_every=3", "log_every=1000", "task.val_size=32",
        "task.test_size=32", "checkpoint.every=0", "seed=4", "batch_size=8", "optim.lr=1e-3")


@pytest.mark.parametrize("model", ["tiny", "tiny-opt", "tiny-qwen"])
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_offloaded_equals_resident_on_cuda(tmp_path, model, slots):
    """Blocks uploaded on the upload stream, written back on the offload stream, ordered by events:
    the same weights and evaluations as resident training, bitwise (same kernels, same shapes)."""
    _offloaded_equals_resident(tmp_path, [f"model={model}"], slots, "model.safetensors")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_offloaded_half_precision_weights_equal_resident_on_cuda(tmp_path, dtype):
    """The table's weights (OPT in float16 or bfloat16): offloaded = resident bitwise, the same kernels
    on the same shapes; the master is updated in float32 and rounded once on both paths."""
    _offloaded_equals_resident(tmp_path, ["model=tiny-opt", f"model.dtype={dtype}", "optim.lr=1e-2"], 2,
                               "model.safetensors")


def test_the_table_workload_in_miniature_on_cuda(tmp_path):
    """benchmarks/distzo2_table.py's row on a tiny OPT: 2,048-token sequences in float16, weights drawn
    on the device; bench names the card, takes MFU against its fp16 peak and times MeZO's Algorithm 1
    and the profile in the same run."""
    r = run_fresh(1, ["bench", "model=tiny-opt", "+model.arch_config.max_position_embeddings=2048",
                      "model.dtype=float16", "model.init_device=device", "task=lm-2048", "batch_size=4",
                      "device=cuda", "bench.warmup=1", "bench.steps=2", "bench.profile=true",
                      f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "b" / "bench.json").read_text())
    mfu = out["mfu"]
    assert mfu["card"] == torch.cuda.get_device_name(0) and mfu["precision"] == "half"
    assert mfu["value"] is None or 0 < mfu["value"] < 1  # None only on a card distzo's table lacks
    assert out["mezo_reference"]["step_time_s"] > 0 and out["host_memory_bytes"]["load_peak"] > 0
    prof = out["profile"]
    assert prof["time"] == "device kernels" and prof["by_kind_s"]["matmul"] > 0 and 0 < prof["busy_fraction"]


@pytest.mark.parametrize("case", ["offloaded float16", "int8 base under LoRA"])
def test_a_model_drawn_on_the_device_gives_back_what_it_no_longer_holds(tmp_path, case):
    """model.init_device=device draws the whole float model on the GPU before its blocks move to host
    masters (offload=cpu) or its linear weights are quantized: the device peak (reserved memory, what
    bench reports) must then be the run's working set, not the float model's bytes, which torch's
    caching allocator would otherwise keep. An OPT of 24 blocks (302M parameters) and 50M embedding
    parameters on short prompts. Offloaded in float16: the working set is about 300 MB (three 25 MB
    slots, the 100 MB embeddings, two probes' copies of a block, activations) against 704 MB of
    weights; the bound is 0.6x those. int8 under LoRA, drawn in float32 (1.41 GB): about 0.55 GB
    (302 MB of int8, 200 MB of float32 embeddings, LoRA, activations); the bound is 0.75x. A drawn
    model's memory left reserved exceeds either bound by at least 1.3x."""
    shape = ["+model.arch_config.hidden_size=1024", "+model.arch_config.ffn_dim=4096",
             "+model.arch_config.num_hidden_layers=24", "+model.arch_config.num_attention_heads=16",
             "+model.arch_config.word_embed_proj_dim=1024"]
    mode, element, fraction = {"offloaded float16": (["model.dtype=float16", "offload=cpu"], 2, 0.6),
                               "int8 base under LoRA": (["peft=lora", "model.quantize=int8"], 4, 0.75)}[case]
    r = run_fresh(1, ["bench", "model=tiny-opt", *shape, *mode, "model.init_device=device", "device=cuda",
                      "batch_size=4", "bench.warmup=1", "bench.steps=1", "bench.reference=false",
                      f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "b" / "bench.json").read_text())
    weights = element * out["mfu"]["parameters"]
    assert max(out["peak_memory_bytes"].values()) < fraction * weights, (out["peak_memory_bytes"], weights)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("matmul", ["torchao", "decoded"])
def test_a_streamed_quantized_base_equals_resident_on_cuda(tmp_path, quantize, matmul):
    """LoRA on a quantized base streamed from pinned host memory as bytes (engine/streamed_base.py),
    rebuilt as torchao tensors in the device slots: the resident run's adapters, bitwise, with
    torchao's linears and with each weight decoded by distzo's kernel into the shared buffer."""
    _offloaded_equals_resident(tmp_path, ["model=tiny", "peft=lora", f"model.quantize={quantize}", "optim.lr=1e-2",
                                          f"engine.quantized_matmul={matmul}"], 2, "adapter.safetensors")


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_decode_kernels_equal_torchaos_dequantization_on_cuda(weight_dtype, out_dtype):
    """The Triton kernels of engine.quantized_matmul=decoded on the GPU: torchao's int8 and NF4
    dequantization rounded to the output dtype, bitwise (one IEEE multiply, integer rounding to
    bfloat16), as the CPU suite checks under Triton's interpreter."""
    from torch import nn
    from torchao.quantization import Int8WeightOnlyConfig, quantize_, to_nf4

    from distzo.models.decode import decode_reference, decode_with_kernel

    torch.manual_seed(0)
    lin = nn.Linear(2056, 1031, dtype=weight_dtype, device="cuda")
    quantize_(lin, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn == "")
    nf4 = to_nf4(torch.randn(1024, 2048, dtype=weight_dtype, device="cuda") * 0.02, 64, 256)
    for weight in (lin.weight, nf4):
        got = decode_with_kernel(weight, torch.empty(weight.shape, dtype=out_dtype, device="cuda"))
        want = decode_reference(weight, torch.empty(weight.shape, dtype=out_dtype, device="cuda"))
        assert torch.equal(got, want), type(weight).__name__


@pytest.mark.parametrize("args", [["model=tiny-opt", "model.dtype=float16", "optim.lr=1e-2", "optim.weight_decay=0.1"],
                                  ["model=tiny", "estimator.distribution=rademacher", "estimator.q=2"],
                                  ["model=tiny-opt", "model.dtype=bfloat16", "optim.lr=1e-2", "offload=cpu"]])
def test_the_triton_chunk_pass_trains_the_weights_of_torch_ops_on_cuda(tmp_path, args, monkeypatch):
    """engine.native=auto (the Triton chunk kernel, distzo/native/cuda.py) against engine.native=false
    (torch ops): the same weights bitwise after six steps (the same operations, each rounded once);
    the kernel really ran, and every variant's first call agreed with torch ops on this GPU (none
    fell back: a fallback would keep the weights equal and hide a broken kernel)."""
    from distzo import native

    launches, verdicts = [], []
    run, agrees = native.CudaKernels._run, native.CudaKernels._agrees
    monkeypatch.setattr(native.CudaKernels, "_run", lambda self, *a: (launches.append(1), run(self, *a))[1])

    def checked(self, *a):
        verdicts.append(agrees(self, *a))
        return verdicts[-1]

    monkeypatch.setattr(native.CudaKernels, "_agrees", checked)
    res = train(make_config(*FAST, *args, "steps=6", "engine.native=false"), tmp_path / "t")
    assert not launches
    fused = train(make_config(*FAST, *args, "steps=6"), tmp_path / "k")
    assert len(launches) > len(verdicts) > 0 and all(verdicts), verdicts  # verified, then the kernel ran on
    a = load_file(tmp_path / "t" / "final" / "model.safetensors")
    b = load_file(tmp_path / "k" / "final" / "model.safetensors")
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    assert res["validation_accuracy_after"] == fused["validation_accuracy_after"]


# Six blocks: each copy slot is reused (block i + 1 writes the slot block i - 1 read).
@pytest.mark.parametrize("args", [["model=tiny-opt", "model.dtype=float16", "optim.weight_decay=0.1",
                                   "+model.arch_config.num_hidden_layers=6"],
                                  ["model=tiny", "estimator.q=2", "+model.arch_config.num_hidden_layers=6"]])
def test_copies_built_on_the_copy_stream_train_the_weights_of_one_stream_on_cuda(tmp_path, args, monkeypatch):
    """engine.copy_stream (distzo/engine/copystream.py): block i + 1's update and copies on the copy
    stream beside block i's forward on the compute stream, ordered by events, against one stream:
    the same weights and evaluations bitwise after six steps (the same kernels on the same inputs;
    a slot overwritten before its forward read it, or a forward reading copies not yet written,
    would change them). The copy stream really ran; auto turns it on here."""
    from distzo.engine import copystream

    built = []
    build = copystream.CopyStreams.build
    monkeypatch.setattr(copystream.CopyStreams, "build", lambda self, q: (built.append(1), build(self, q))[1])
    one = train(make_config(*FAST, *args, "optim.lr=1e-2", "steps=6", "engine.copy_stream=false"), tmp_path / "one")
    assert not built
    two = train(make_config(*FAST, *args, "optim.lr=1e-2", "steps=6"), tmp_path / "two")
    assert built
    a = load_file(tmp_path / "one" / "final" / "model.safetensors")
    b = load_file(tmp_path / "two" / "final" / "model.safetensors")
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    assert (one["validation_accuracy_after"], one["test_accuracy"]) == (two["validation_accuracy_after"],
                                                                      two["test_accuracy"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("distribution", ["gaussian", "rademacher"])
def test_the_chunk_kernel_equals_torch_ops_on_cuda(dtype, distribution):
    """The compiled kernel on a span of three chunks (the last short) and on a slice across them:
    sgd's update with decay and terms of both signs, then + and - copies, bitwise the torch path's."""
    from distzo.engine.chunkpass import _decay, _torch_ops
    from distzo.engine.pending import PendingUpdate
    from distzo.native.cuda import CudaKernels
    from distzo.zo.directions import ChunkRef
    from distzo.zo.optimizers import SGD
    from distzo.zo.params import TrainableParam

    numel, per_chunk = 3 * 70_000 - 999, 70_000
    for part in (None, (4_097, 150_001)):
        lr = 3e-3 if dtype == torch.float32 else 0.05
        pending = PendingUpdate(6, ((0, 0.8), (1, -1.3)), lr, 0.1, SGD().rule(6, lr, 0.1))
        results = []
        for fused in (False, True):
            d = Directions(11, distribution, "cuda")
            tensor = (torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 0.5).to(dtype).cuda()
            p = TrainableParam("w", tensor, param_key("w"), True)
            lo, hi = part or (0, numel)
            copies = {0: [(1, torch.empty(hi - lo, dtype=dtype, device="cuda")),
                          (-1, torch.empty(hi - lo, dtype=dtype, device="cuda"))]}
            ref = ChunkRef(p.key, 4, 0, numel, per_chunk)
            if fused:
                CudaKernels(verify=False).chunk_pass(d, p, ref, tensor[lo:hi], pending, 7, 1e-3, copies, part,
                                                     _decay(p, pending), _torch_ops)
            else:
                _torch_ops(d, p, ref, tensor[lo:hi], pending, 7, 1e-3, copies, part, ())
            results.append([tensor] + [o for outs in copies.values() for _, o in outs])
        for a, b in zip(*results):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (part, int((a != b).sum()))


def _offloaded_equals_resident(tmp_path, args, slots, weights):
    res = train(make_config(*FAST, *args, "steps=6"), tmp_path / "r")
    off = train(make_config(*FAST, *args, "steps=6", "offload=cpu", f"offload.slots={slots}"), tmp_path / "o")
    a = load_file(tmp_path / "r" / "final" / weights)
    b = load_file(tmp_path / "o" / "final" / weights)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert res["validation_accuracy_after"] == off["validation_accuracy_after"]


@pytest.mark.parametrize("run", [
    ["estimator=mezo"], ["estimator=mezo", "estimator.distribution=rademacher", "estimator.q=2"],
    ["estimator=prge", "peft=lora_fa", "estimator.q=2", "optim.lr=0.5"], ["estimator=agzo"],
    ["peft=lora", "optim.lr=1e-2"], ["peft=prefix", "estimator.eps=1e-1", "optim.lr=1e-2"],
    ["offload=cpu", "offload.transfer_dtype=bfloat16"], ["engine.compute=bf16"], ["engine.compute=tf32"],
    ["offload=cpu", "engine.compute=bf16"], ["estimator=agzo", "engine.compute=bf16"],
    ["peft=lora", "model.quantize=int8", "optim.lr=1e-2"], ["peft=lora", "model.quantize=int4", "optim.lr=1e-2"],
    ["estimator=prge", "peft=lora_fa", "model.quantize=int4", "estimator.q=2", "optim.lr=0.5"],
    ["peft=lora", "model.quantize=int8", "offload=cpu", "optim.lr=1e-2"],
    # HiZOO: its Hessian shapes the copies (torch ops on CUDA), resident and with offloaded blocks' state
    ["estimator.clean=true", "optim.name=hizoo", "optim.alpha=1e-3"],
    ["estimator.clean=true", "optim.name=hizoo", "optim.alpha=1e-3", "offload=cpu"],
])
def test_every_estimator_trainable_set_and_compute_mode_trains_on_cuda(tmp_path, run):
    summary = train(make_config(*FAST, "model=tiny", "steps=4", *run), tmp_path / "run")
    assert summary["steps"] == 4 and 0 <= summary["test_accuracy"] <= 1
    tested = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")
              if r["type"] == "eval" and r["split"] == "test"][-1]
    assert tested["step"] == 4 and tested["examples"] == 32  # task.test_size=32
    assert summary["test_accuracy"] == tested["accuracy"]
    assert tested["accuracy"] * 32 == pytest.approx(round(tested["accuracy"] * 32), abs=1e-9)  # k of 32 right


def test_sliced_offload_on_two_ranks_of_one_gpu_equals_one_process(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("sliced offloading over NCCL needs two GPUs")
    ref = tmp_path / "ref"
    train(make_config(*FAST, "model=tiny", "steps=4"), ref)
    r = run_fresh(2, ["train", *FAST, "model=tiny", "steps=4", "mesh=2x1", "offload=cpu",
                      f"hydra.run.dir={tmp_path / 's'}"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = load_file(ref / "final" / "model.safetensors"), load_file(tmp_path / "s" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bench_on_the_1b_preset(tmp_path):
    r = run_fresh(1, ["bench", "model=llama-1b", "device=cuda", "bench.warmup=1", "bench.steps=2",
                      f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert out["device"] == "cuda" and out["step_time_s"] > 0


def _gaussian_reference(seed: int, n: int) -> torch.Tensor:
    """The CUDA Gaussian stream's definition (distzo/zo/cuda_draws.py) in float64 torch ops on the CPU:
    elements 2j and 2j + 1 are r cos t and r sin t of word j."""
    words = stream_words(as_int64(seed), torch.arange((n + 1) // 2, dtype=torch.int64))
    u1 = (((words >> 40) & 0xFFFFFF).double() + 1) / 2 ** 24
    u2 = ((words >> 16) & 0xFFFFFF).double() / 2 ** 24
    r, t = torch.sqrt(-2 * torch.log(u1)), math.pi * (2 * u2 - 1)
    return torch.stack([r * torch.cos(t), r * torch.sin(t)], dim=1).reshape(-1)[:n], r.repeat_interleave(2)[:n]


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_cuda_directions_are_the_counter_streams(distribution):
    """One launch per span draws each chunk's stream: Rademacher bitwise the CPU's stream; Gaussian the
    Box-Muller pairs of the chunk's SplitMix64 words against float64, within 5e-5 + 2.2e-7 / r (the
    GPU's approximate ln, cos and sin: cos's and sin's absolute 2^-20.9 move z by r times 5e-7, under
    3e-6 for r <= 5.8, float32's rounding of t by 1e-6; ln's error, up to 2^-22.6 absolute on log2,
    moves r^2 = -2 ln u1 by d = 2 ln(2) 2^-22.6 = 2.19e-7 and so r by at most d / r, since
    |sqrt(x + d) - sqrt(x)| <= d / sqrt(x); this only near u1 = 1, where r is small, exceeds the rest);
    rows (element by element, from any offset), single chunks and scaled draws are the same values."""
    d = Directions(3, distribution, "cuda")
    shape, key, step, q = (3000, 701), param_key("layers.0.w"), 5, 1  # odd rows and chunks
    z = d.generate(shape, key, step, q)
    flat = z.view(-1).cpu()
    refs = chunks_of(key, shape)
    assert len(refs) == 3 and len(d.units(key, shape)) == 1  # three chunks, one launch
    for ref in refs:
        seed, n = d.chunk_seed(step, q, key, ref.index), ref.stop - ref.start
        got = flat[ref.start:ref.stop]
        if distribution == "rademacher":
            assert torch.equal(got, stream_signs(seed, 0, n))
        else:
            want, radius = _gaussian_reference(seed, n)
            assert not got.isnan().any() and ((got.double() - want).abs() <= 5e-5 + 2.2e-7 / radius).all()
        one = d.fill_chunk(torch.empty(n, device="cuda"), step, q, ref)
        assert torch.equal(one.cpu(), got)
        scaled = d.fill_chunk(torch.empty(n, device="cuda"), step, q, ref, 1e-3)
        assert torch.equal(scaled, one.mul_(1e-3))
    rows = torch.tensor([2999, 0, 1496, 1497, 1498, 1500], device="cuda")
    assert torch.equal(d.rows(shape, key, step, q, rows), z[rows])
    if distribution == "gaussian":
        assert abs(flat.mean().item()) < 5e-3 and abs(flat.std().item() - 1) < 5e-3


def test_reduced_precision_streaming_keeps_blocks_and_deltas_apart():
    """Eight 8M-element blocks through two slots at bfloat16, the host far ahead of the GPU (no
    synchronisation but the streamer's own): every slot holds exactly its block when computed on, and
    every delta written back reaches its own block's host master (the host worker adds it) before
    that block is uploaded again. Block j holds the value j, and each pass adds 0.5 to every block."""
    from distzo.engine.streamer import (
        BlockStreamer,
        CudaReducedPrecisionTransfer,
        HostBlock,
        host_buffer,
    )

    n, numel = 8, 1 << 23
    blocks = []
    for j in range(n):
        flat = host_buffer(numel, torch.float32, pin=True)
        flat.fill_(float(j))
        blocks.append(HostBlock(f"b{j}", [f"b{j}.w"], [torch.Size([numel])], [0], flat, flat, numel, 1))
    streamer = BlockStreamer(blocks, torch.device("cuda"), slots=2, transfer_dtype=torch.bfloat16)
    assert isinstance(streamer.transfer, CudaReducedPrecisionTransfer)  # the host worker threads' path
    seen = []
    try:
        for rnd in range(3):
            for i in range(n):
                for j in range(i, min(i + 2, n)):
                    streamer.prefetch(j)
                w = streamer.acquire(i)[f"b{i}.w"]
                seen.append((rnd, i, torch.stack([w.min(), w.max()])))  # queued on the compute stream
                streamer.delta_views(i)[f"b{i}.w"].fill_(0.5)
                streamer.release(i, write_back=True)
        streamer.synchronize()
        for rnd, i, got in seen:
            assert got.tolist() == [i + 0.5 * rnd] * 2, (rnd, i, got.tolist())
        for j, b in enumerate(blocks):
            assert torch.equal(b.flat, torch.full_like(b.flat, j + 1.5))
    finally:
        streamer.close()
        from distzo.engine.streamer import unpin_all
        unpin_all()


def test_a_row_wider_than_the_grid_limit_is_drawn_whole():
    """A chunk is at least one row: a row of 2^26 + 5 elements needs more than the 65,535 blocks of a
    grid's second dimension, so the kernel runs on one dimension. Its tail is the counter stream's."""
    d = Directions(5, "rademacher", "cuda")
    shape, key = (2, (1 << 26) + 5), param_key("wide")
    z = d.generate(shape, key, 1, 0)
    for ref in chunks_of(key, shape):
        seed, n = d.chunk_seed(1, 0, key, ref.index), ref.stop - ref.start
        tail = z.view(-1)[ref.stop - 1000:ref.stop].cpu()
        assert torch.equal(tail, stream_signs(seed, n - 1000, 1000))


def test_zotrainer_offloaded_on_cuda_equals_resident(tmp_path):
    """examples/hf_trainer.py's ZOTrainer with ZOArguments(offload="cpu") on the GPU, evaluating every 4
    steps through Trainer's own evaluation loop, against the same script resident: the same weights,
    bitwise (offloaded = resident, the same kernels on the same shapes), and the same evaluations:
    Trainer's stock forward streams the offloaded blocks through the device (the engine's
    `stock_forward`; its mechanism is checked on a CPU in tests/unit/test_engine_modes.py). Not yet
    run on a GPU."""
    from tests.e2e.test_hf import SCRIPT, example, save_tiny_llama

    folder = save_tiny_llama(tmp_path / "tiny-llama")
    runs = {}
    for offload in ("none", "cpu"):
        trainer = example(SCRIPT).build(str(folder), str(tmp_path / offload), 8, None, offload=offload,
                                        training=dict(eval_steps=4))
        trainer.train()
        runs[offload] = (trainer.model.state_dict(), [h["eval_loss"] for h in trainer.state.log_history
                                                      if "eval_loss" in h])
    (resident, resident_evals), (offloaded, offloaded_evals) = runs["none"], runs["cpu"]
    assert all(torch.equal(resident[k].cpu(), offloaded[k].cpu()) for k in resident)
    assert offloaded_evals == resident_evals and len(resident_evals) == 2


@pytest.mark.parametrize("offload", [["offload=cpu"], ["offload=cpu", "peft=lora", "model.quantize=int8",
                                                        "optim.lr=1e-2"]])
def test_a_generation_task_evaluates_with_blocks_in_host_memory(tmp_path, offload):
    """Generation tasks evaluate with the stock generate; with the blocks (or the quantized base) in
    host memory its forwards stream them through the device (Engine.stock_forward): the same
    answers and weights as resident, bitwise (the same kernels on the same shapes)."""
    rows = [{"prompt": f"Translate {w} to French:", "completion": f"le {w}"} for w in
            ["cat", "dog", "house", "tree", "car", "book", "sun", "moon", "river", "stone", "bread", "water"] * 3]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [*FAST, "model=tiny", "steps=2", "task=custom", "task.kind=generation", f"task.path={data}",
            "task.template='{prompt}'", "task.answers_field=completion", "task.max_new_tokens=4",
            "task.val_size=4", "task.test_size=4", *[a for a in offload if a != "offload=cpu"]]
    res = train(make_config(*args), tmp_path / "r")
    off = train(make_config(*args, "offload=cpu"), tmp_path / "o")
    assert (res["validation_f1_after"], res["test_f1"]) == (off["validation_f1_after"], off["test_f1"])
    name = "adapter.safetensors" if "peft=lora" in offload else "model.safetensors"
    a, b = load_file(tmp_path / "r" / "final" / name), load_file(tmp_path / "o" / "final" / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
