"""engine.quantized_matmul=decoded (distzo/models/decode.py): the Triton kernels decode torchao's int8
and NF4 weights to exactly torchao's dequantization (checked on a CPU under Triton's interpreter), and
the hooks run the stock layers on the decoded weight in one shared buffer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from distzo.models.decode import DecodedLinears
from distzo.models.loading import random_model
from distzo.models.quantize import quantize_base

KERNEL_CHECK = textwrap.dedent("""
    import torch
    from torch import nn
    from torchao.quantization import Int8WeightOnlyConfig, quantize_, to_nf4
    from distzo.models.decode import KernelDecode, decode_reference, decode_with_kernel
    torch.manual_seed(0)
    bad = []
    for wdt in (torch.float32, torch.bfloat16):
        lin = nn.Linear(520, 37, dtype=wdt)  # 19,240 elements: not a multiple of the kernel's 1,024
        lin.weight.data.mul_(40)  # values past bfloat16's small exponents too
        quantize_(lin, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn == "")
        nf4 = to_nf4(torch.randn(96, 512, dtype=wdt) * 0.02, 64, 256)
        # 1,920 elements: 30 blocks of 64 (a program's 16 blocks and a partial one), scaler blocks of 2
        nf4_small = to_nf4(torch.randn(20, 96, dtype=wdt) * 0.02, 64, 2)
        for weight in (lin.weight, nf4, nf4_small):
            for out in (torch.float32, torch.bfloat16, torch.float16):
                got = decode_with_kernel(weight, torch.empty(weight.shape, dtype=out))
                want = decode_reference(weight, torch.empty(weight.shape, dtype=out))
                if not torch.equal(got, want):
                    bad.append((type(weight).__name__, str(wdt), str(out), int((got != want).sum())))
    # A prepared launch reads the weight's own tensors: it decodes what they hold at each call.
    lin = nn.Linear(300, 5)
    quantize_(lin, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn == "")
    run = KernelDecode(lin.weight, torch.empty(lin.weight.shape))
    assert run.reusable
    first = run().clone()
    lin.weight.qdata.neg_()
    if not torch.equal(run(), decode_reference(lin.weight, torch.empty(lin.weight.shape))) or torch.equal(run(), first):
        bad.append("reuse")
    print("mismatches", bad)
""")


def test_the_kernels_equal_torchaos_dequantization_under_the_interpreter():
    """The same Triton source that runs on CUDA, run by Triton's interpreter on CPU tensors: int8 and
    NF4 weights stored in float32 and bfloat16, decoded to float32, bfloat16 and float16, equal
    torchao's `dequantize` / `get_original_weight` rounded to that dtype, bitwise (the bfloat16
    rounding is integer arithmetic, ties to even, so it cannot differ between the two)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "mismatches []" in r.stdout, r.stdout[-2000:]


def test_the_c_kernels_equal_torchaos_dequantization(kernels):
    """On a CPU the C kernels decode float32 int8 and NF4 weights to torchao's `dequantize` /
    `get_original_weight` bitwise (the same float32 operations, each rounded once): int8 a scale a
    row; NF4 in blocks of 64 with scalers in groups of 256 (distzo's setting, one factor for several
    rows) and of 2 (a factor every 128 weights), into float32 and into bfloat16 (rounded as torch
    converts: to nearest, ties to even, subnormals kept; crafted values check the ties). A prepared
    decode reads the weight's own tensors, so it decodes what they hold at each call (a streamed slot
    refilled in place). Outputs the kernels do not write (float16) go to torchao's dequantization."""
    from torch import nn
    from torchao.quantization import Int8WeightOnlyConfig, quantize_, to_nf4

    from distzo.models.decode import NativeDecode, ReferenceDecode, decode_reference, decoder

    torch.manual_seed(0)
    lin = nn.Linear(520, 37)
    lin.weight.data.mul_(40)
    quantize_(lin, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn == "")
    weights = (lin.weight, to_nf4(torch.randn(96, 512) * 0.02, 64, 256), to_nf4(torch.randn(20, 96) * 0.02, 64, 2))
    for weight in weights:
        for dtype in (torch.bfloat16, torch.float32):
            run = decoder(weight, torch.empty(weight.shape, dtype=dtype), kernels)
            assert isinstance(run, NativeDecode) and run.reusable
            assert torch.equal(run(), decode_reference(weight, torch.empty(weight.shape, dtype=dtype)))
        assert isinstance(decoder(weight, torch.empty(weight.shape, dtype=torch.float16), kernels), ReferenceDecode)
    first = run().clone()
    weights[2].quantized_data.copy_(weights[1].quantized_data[:weights[2].quantized_data.numel()])
    weights[2].scaler_mean.mul_(-3)
    assert not torch.equal(run(), first) and torch.equal(run(), decode_reference(weights[2], torch.empty(20, 96)))
    # bfloat16 rounding of chosen float32 patterns (ties to even either way, the largest float, a
    # subnormal, infinities, zeros): as NF4 table values times a scaler of exactly 0 / 1 + 1
    patterns = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x00000001, 0x80008000, 0x7F800000, 0xFF800000,
                0x3F800001, 0x00400000, 0x80400000, 0x3FFF8000, 0x477FE000, 0x7F7F8000, 0x0, 0x80000000]
    lut = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    packed = torch.tensor([0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF], dtype=torch.uint8)
    got = kernels.decode_nf4(packed, lut, torch.zeros(1, dtype=torch.int8), torch.ones(1), 1.0, 16, 1,
                             torch.empty(16, dtype=torch.bfloat16))
    assert torch.equal(got.view(torch.int16), lut.bfloat16().view(torch.int16))
    nan = torch.full((16,), float("nan"))  # a NaN stays one (its bits follow torch's vectorised conversion)
    assert kernels.decode_nf4(packed, nan, torch.zeros(1, dtype=torch.int8), torch.ones(1), 1.0, 16, 1,
                              torch.empty(16, dtype=torch.bfloat16)).isnan().all()


@pytest.mark.parametrize("arch,method", [("llama", "int8"), ("llama", "int4"), ("opt", "int4")])
def test_on_a_cpu_torchaos_nf4_linears_decode_in_one_pass_with_torchaos_result(kernels, arch, method):
    """engine.quantized_matmul=torchao on a CPU with the kernels: an NF4 layer's float32 call decodes
    its weight with the C kernel, runs F.linear on it and adds the bias after, which is what torchao's
    NF4 linear computes (F.linear on get_original_weight, then + bias), so the logits are torchao's
    bitwise (OPT: 512 wide, every linear with a random bias, which F.linear's fused bias would round
    differently), under bfloat16 autocast too (decoded to bfloat16, as torchao's weight is cast); int8
    calls (torchao scales the product, not the weight) are left to torchao's forward. The bias is
    added before any other forward hook's term (here one registered first), as torchao adds it inside
    the layer. A call that raises leaves the layer its quantized weight and bias."""
    from distzo.models.decode import NativeDecode

    wide = {"hidden_size": 512, "ffn_dim": 1024, "num_hidden_layers": 1, "word_embed_proj_dim": 512}
    model = random_model(arch, 400, wide if arch == "opt" else {}, 0, torch.float32)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.bias is not None:
            torch.nn.init.normal_(m.bias, std=0.5)
    layers = quantize_base(model, method).modules(model)
    for layer in layers:  # a hook registered before the decode's (as an adapter's could be) still sees out + bias
        layer.register_forward_hook(lambda m, args, out: out * 1.5 + 0.37)
    ids = torch.randint(3, 400, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want_bf16 = model(ids).logits
    hooks = DecodedLinears(layers, kernels=kernels, only_same=True)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model(ids).logits, want_bf16)
    decoded = set(hooks.prepared.values())
    if method == "int4":
        assert len(decoded) == len(layers) and all(isinstance(run, NativeDecode) for run in decoded)
        assert all(run.out.dtype == torch.bfloat16 for run in decoded)  # the last calls, under autocast
    else:
        assert not decoded
    assert all(type(layer.weight).__name__ in ("Int8Tensor", "NF4Tensor") for layer in layers)
    layer, biases = layers[0], [layer.bias for layer in layers]
    with pytest.raises(RuntimeError), torch.no_grad():
        layer(torch.randn(3, layer.in_features + 1))
    assert type(layer.weight).__name__ in ("Int8Tensor", "NF4Tensor") and [m.bias for m in layers] == biases
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    hooks.remove()


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("native", [False, True])
def test_the_hooks_run_the_float_layer_on_the_decoded_weight(method, autocast, native, request):
    """A quantized tiny model with the hooks gives the logits of a float model whose linear weights
    are torchao's dequantization, bitwise (the same F.linear on the same values), decoded by the C
    kernels or by torchao, under bfloat16 autocast too (the buffer is then bfloat16, as autocast
    would cast). Outside a call each layer
    holds its quantized weight again, and the buffer is the largest layer's size, shared."""
    model = random_model("llama", 400, {}, 0, torch.float32)
    float_model = random_model("llama", 400, {}, 0, torch.float32)
    report = quantize_base(model, method)
    layers = report.modules(model)
    for layer in layers:  # the float twin: torchao's dequantization in place of each quantized weight
        deq = layer.weight.dequantize() if method == "int8" else layer.weight.get_original_weight()
        float_model.get_submodule(next(n for n, m in model.named_modules() if m is layer)).weight.data = deq
    hooks = DecodedLinears(layers, kernels=request.getfixturevalue("kernels") if native else None)
    ids = torch.randint(3, 400, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
        got, want = model(ids).logits, float_model(ids).logits
    assert torch.equal(got, want)
    assert all(type(layer.weight).__name__ in ("Int8Tensor", "NF4Tensor") for layer in layers)
    (key, buffer), = hooks.scratch.items()
    assert key[1] == (torch.bfloat16 if autocast else torch.float32)
    assert buffer.numel() == max(layer.weight.numel() for layer in layers)
    hooks.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
        torchao = model(ids).logits  # torchao's own forward again
    if method == "int4":  # NF4's linear is F.linear on get_original_weight, as ours (autocast casts it alike)
        assert torch.equal(torchao, got)
    elif not autocast:  # int8 scales the product, not the weight: a few float32 roundings, relative 1e-7 each
        assert (torchao - got).abs().max() <= 1e-5 * got.abs().max()
    else:  # under autocast ours rounds q * scale to bfloat16 (2^-9 relative) where torchao keeps q exact
        assert (torchao.float() - got.float()).abs().max() <= 1e-2 * got.float().abs().max()  # measured 3.3e-3


def test_decoded_is_refused_without_a_quantized_base():
    from distzo.errors import ConfigError
    from tests.conftest import make_config

    with pytest.raises(ConfigError, match="engine.quantized_matmul=decoded sets how a quantized base multiplies"):
        make_config("model=tiny", "engine.quantized_matmul=decoded")


def test_auto_decodes_on_cuda_and_keeps_torchaos_linears_elsewhere(monkeypatch):
    """engine.quantized_matmul=auto (the default) is `decoded` on CUDA and `torchao` on CPU, and the
    resume fingerprint records what it resolved to: a run under auto resumes a run of the mode it
    means on that device, and a CUDA snapshot of torchao's linears is not resumed with decoded ones
    (their products round differently)."""
    from distzo.models.quantize import matmul_mode
    from distzo.state.resume import config_fingerprint
    from tests.conftest import make_config

    assert (matmul_mode("auto", "cuda"), matmul_mode("auto", "cpu")) == ("decoded", "torchao")
    assert matmul_mode("torchao", "cuda") == "torchao" and matmul_mode("decoded", "cpu") == "decoded"
    base = ("model=tiny", "peft=lora", "model.quantize=int8")

    def fingerprint(*extra):
        return config_fingerprint(make_config(*base, *extra))

    assert make_config(*base).engine.quantized_matmul == "auto"
    assert fingerprint("device=cpu") == fingerprint("device=cpu", "engine.quantized_matmul=torchao")
    assert fingerprint("device=cpu") != fingerprint("device=cpu", "engine.quantized_matmul=decoded")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fingerprint("device=auto") == fingerprint("device=cuda", "engine.quantized_matmul=decoded")
    assert fingerprint("device=auto") != fingerprint("device=cuda", "engine.quantized_matmul=torchao")
    # without a quantized base the setting means nothing, and counts for nothing
    assert config_fingerprint(make_config("model=tiny", "device=cuda")) == config_fingerprint(
        make_config("model=tiny", "device=cpu"))
