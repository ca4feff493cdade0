"""The decode cache (engine.decode_cache, distzo/engine/decoding.py): a decoding objective's answers
generated with each attention layer's keys and values kept across the walks are the tokens of
decoding without it (every walk over the prompts and what they generated), on every family, under
perturbations, in packed rows with padded tails and through sliding windows; a cache that does not
reproduce decoding without it is caught on the first decode."""

from __future__ import annotations

import logging

import pytest
import torch

from distzo.data.batches import Batch, TokenSequence
from distzo.engine import resident_engine
from distzo.engine.base import EngineConfigError
from distzo.models.kv_cache import DecodeKV, unsupported_reason
from distzo.models.loading import random_model
from distzo.models.selection import adapter_for
from distzo.zo.directions import Directions
from distzo.zo.estimators import Probe
from distzo.zo.params import TrainableParams

VOCAB = 300
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "opt",  # the dedicated adapters
            "gpt2", "gpt_neox", "phi", "phi3", "gemma3_text", "falcon", "stablelm"]  # the general path
PLAN = [Probe(0, +1), Probe(0, -1), Probe(1, +1)]
TOKENS = 5


def decode_batch(lengths=(5, 12, 1, 9, 7, 3), tokens: int = TOKENS, seed: int = 1) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    seqs = [TokenSequence(tuple(torch.randint(3, VOCAB, (n,), generator=gen).tolist()), scored=(), targets=(),
                          units=()) for n in lengths]
    n = len(seqs)
    return Batch(seqs, list(range(n)), list(range(n)), torch.zeros(n, dtype=torch.long), readout="decode",
                 decode_tokens=tokens)


def decoded(model, adapter, cache: str, batch: Batch, row_tokens: int, step: int = 3, verify: bool = False):
    """Every probe's generated tokens, and the engine's decoder (what it chose). verify: every cached
    walk's logits are compared with a walk without the cache (`decoder.worst`: the largest difference)."""
    engine = resident_engine(model, adapter, TrainableParams.from_model(model), Directions(7), eps=3e-2,
                             row_tokens=row_tokens, decode_cache=cache)
    engine.decoder.verify_every_walk = verify
    try:
        scores = engine.run_probes(batch, PLAN, step)
        return [scores[i].generated for i in range(len(PLAN))], engine.decoder
    finally:
        engine.close()


@pytest.mark.parametrize("arch", FAMILIES)
def test_decoding_with_the_cache_gives_the_tokens_of_decoding_without_it(arch, caplog):
    """Float64, so that the two paths' rounding (the same products over differently shaped keys:
    at most 9e-16 measured, against logits of O(0.1-1)) cannot flip an argmax, and every cached
    walk's logits are within 1e-12 of the same walk's without the cache (a position or a mask off
    by one moves them by more than 1e-4). Row budgets of 1024 (one row; a dedicated and a general
    family) and 13 tokens (several rows,
    tails padded, rows holding different numbers of sequences, so a later walk's rows have padding
    columns too; the harder case, so the only one on most families). The run's own check ran and
    passed: the cache was used."""
    model = random_model(arch, VOCAB, {}, 0, torch.float64)
    adapter = adapter_for(model)
    batch = decode_batch()
    for row_tokens in (1024, 13) if arch in ("llama", "gpt2") else (13,):
        want, plain = decoded(model, adapter, "false", batch, row_tokens)
        assert plain.off == "engine.decode_cache=false" and not plain.checked
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="distzo.engine.decoding"):
            got, decoder = decoded(model, adapter, "true", batch, row_tokens, verify=True)
        assert decoder.off is None and decoder.checked and decoder.worst <= 1e-12
        assert "decoding with a KV cache (checked" in caplog.text
        assert got == want
        assert all(len(g) == TOKENS for probe in got for g in probe)
        assert got[0] != got[1]  # the probes decode under their own perturbations


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
def test_eager_attention_gets_additive_masks(arch):
    """The eager implementation adds its mask to the scores: its stock masks are floats, and the later
    walks' masks are additive floats of the same dtype (0 attends, the dtype's lowest value does not).
    Eager attention takes its softmax in float32 whatever the model's dtype, so the two paths differ
    at float32 rounding (1.9e-7 measured); a misplaced mask or position moves logits by more than 1e-4."""
    model = random_model(arch, VOCAB, {"sliding_window": 4} if arch == "gemma3_text" else {}, 0, torch.float64)
    model.config._attn_implementation = "eager"
    adapter = adapter_for(model)
    batch = decode_batch()
    want, _ = decoded(model, adapter, "false", batch, 13)
    got, decoder = decoded(model, adapter, "true", batch, 13, verify=True)
    assert decoder.off is None and decoder.checked and decoder.worst <= 1e-5 and got == want


def test_a_row_of_one_sequence_whose_stock_mask_is_none():
    """One sequence alone: sdpa's mask helper hands the attention no mask (causal by `is_causal`);
    the later walks' masks are then sdpa's booleans."""
    from transformers.masking_utils import create_causal_mask

    from distzo.models.adapters import build_mask

    model = random_model("llama", VOCAB, {}, 0, torch.float64)
    shaped = torch.empty((1, 7, 1), dtype=torch.float64)
    assert build_mask(create_causal_mask, model.config, shaped, torch.arange(7)[None]) is None
    batch = decode_batch(lengths=(7,))
    want, _ = decoded(model, adapter_for(model), "false", batch, 1024)
    got, decoder = decoded(model, adapter_for(model), "true", batch, 1024, verify=True)
    assert decoder.off is None and decoder.worst <= 1e-12 and got == want


def test_mask_forms():
    """A later walk's mask takes the form the first walk's stock mask had: sdpa's booleans (True
    attends), a boolean where True masks (MPT's), additive floats; an unknown form is an error (the
    first decode then falls back, or fails naming engine.decode_cache=false)."""
    from distzo.models.kv_cache import mask_form

    causal = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    assert mask_form(causal) == "bool" and mask_form(~causal) == "inverted" and mask_form(None) == "none"
    assert mask_form(torch.zeros(3, 3).masked_fill(~causal, -1e9)) == "additive"
    with pytest.raises(TypeError, match="first token does not attend to itself"):
        mask_form(torch.ones(1, 1, 3, 3))
    with pytest.raises(TypeError, match="attention mask, not a"):
        mask_form(object())
    kv = DecodeKV([None])
    kv.extend(torch.tensor([[0, 0, 1]]), torch.tensor([[0, 1, 0]]), first=True)
    kv.note_stock_mask(0, ~causal)
    kv.extend(torch.tensor([[0, 1]]), torch.tensor([[2, 1]]), first=False)
    seen = torch.tensor([[[[1, 1, 0, 1, 0], [0, 0, 1, 0, 1]]]], dtype=torch.bool)  # own sequence, not ahead
    assert torch.equal(kv.mask(0, None), ~seen)


def test_an_attention_that_fails_with_the_stand_in():
    """MPT's attention asks the cache for more than `update`. On resident weights, auto warns and
    decodes without the cache from the start: the first walk failed at block 0's forward after
    applying block 0's share of a pending update, and the walk again applies the rest once, so the
    tokens are those of decoding without the cache after the same update. true fails naming the fix."""
    from transformers import MptConfig, MptForCausalLM

    def mpt():
        torch.manual_seed(0)
        return MptForCausalLM(MptConfig(d_model=32, n_heads=2, n_layers=2, vocab_size=VOCAB, max_seq_len=64)).eval()

    batch = decode_batch()
    got = {}
    for cache in ("false", "auto"):
        model = mpt()
        params = TrainableParams.from_model(model)
        engine = resident_engine(model, adapter_for(model), params, Directions(7), eps=3e-2, decode_cache=cache)
        engine.run_probes(decode_batch(tokens=1), PLAN, 1)  # a step's decode (one token: no cache yet)
        engine.apply(1, [(0, 0.7)], 5e-1, 0.0)  # pending until the next walk
        scores = engine.run_probes(batch, PLAN, 2)
        with engine.materialized():
            weights = {p.name: p.tensor.clone() for p in params}
        got[cache] = ([scores[i].generated for i in range(len(PLAN))], engine.decoder.off, weights)
        engine.close()
    assert got["auto"][0] == got["false"][0]
    assert "decoding with distzo's KV cache failed (AttributeError" in got["auto"][1]
    assert all(torch.equal(got["auto"][2][k], got["false"][2][k]) for k in got["false"][2])
    model = mpt()
    adapter = adapter_for(model)
    with pytest.raises(EngineConfigError, match=r"failed \(AttributeError: .*\); use engine.decode_cache=false"):
        decoded(model, adapter, "true", batch, 1024)


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_the_cache_keeps_sliding_windows(arch):
    """A window of 4 tokens, below the prompts' lengths: every layer's (Mistral) or the sliding
    layers' (Gemma 3, full layers between) later walks see only the last 4 positions of their
    sequence, as the mask helpers' window does without the cache."""
    model = random_model(arch, VOCAB, {"sliding_window": 4}, 0, torch.float64)
    adapter = adapter_for(model)
    batch = decode_batch(lengths=(9, 6, 11), tokens=6)
    want, _ = decoded(model, adapter, "false", batch, 1024)
    got, decoder = decoded(model, adapter, "true", batch, 1024, verify=True)
    assert decoder.off is None and decoder.checked and decoder.worst <= 1e-12 and got == want


def test_the_whole_model_fallback_decodes_with_the_cache():
    from tests.unit.test_generic_adapter import cohere

    model = cohere().double()
    adapter = adapter_for(model)
    assert adapter.family == "whole-model"
    batch = decode_batch()
    want, _ = decoded(model, adapter, "false", batch, 13)
    got, decoder = decoded(model, adapter, "true", batch, 13, verify=True)
    assert decoder.off is None and decoder.checked and decoder.worst <= 1e-12 and got == want


def test_a_cache_that_does_not_reproduce_decoding_is_caught(monkeypatch, caplog):
    """A cache whose later walks let every token see the whole row (the other sequences packed in
    it, the padding) moves the logits by O(1). auto: warned, and the run decodes without the cache from
    that walk on, so the tokens are still decoding's without it; true: an error naming the fix."""
    model = random_model("llama", VOCAB, {}, 0, torch.float64)
    adapter = adapter_for(model)
    batch = decode_batch()
    want, _ = decoded(model, adapter, "false", batch, 1024)
    right = DecodeKV.mask

    def leaky(self, layer, like):
        mask = right(self, layer, like)
        return mask if mask is like else torch.ones_like(mask, dtype=torch.bool)

    monkeypatch.setattr(DecodeKV, "mask", leaky)
    with caplog.at_level(logging.WARNING, logger="distzo.engine.decoding"):
        got, decoder = decoded(model, adapter, "auto", batch, 1024)
    assert got == want and decoder.off is not None
    assert "does not reproduce decoding without it" in caplog.text and "decoding without the cache" in caplog.text
    with pytest.raises(EngineConfigError, match=r"engine.decode_cache=true: .* does not reproduce decoding without "
                                                r"it .*; use engine.decode_cache=auto"):
        decoded(model, adapter, "true", batch, 1024)


def test_where_the_cache_cannot_run():
    """Prefix tuning (its prefix goes through the same cache argument) and an attention implementation
    without explicit masks: auto decodes without the cache; true is refused when the engine is built."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from distzo.peft.prefix import attach_prefix

    model = random_model("llama", VOCAB, {}, 0, torch.float32)
    model.config._attn_implementation = "flash_attention_2"
    assert "attention implementation 'flash_attention_2'" in unsupported_reason(model, 2)
    neo = GPTNeoForCausalLM(GPTNeoConfig(hidden_size=32, num_layers=2, attention_types=[[["global", "local"], 1]],
                                         num_heads=2, vocab_size=VOCAB, window_size=4))
    assert "local attention (window_size=4)" in unsupported_reason(neo, 2)
    model = random_model("llama", VOCAB, {}, 0, torch.float32)
    attach_prefix(model, 2, 0)
    batch = decode_batch(tokens=3)
    want = decoded(model, adapter_for(model), "false", batch, 1024)[0]
    got, decoder = decoded(model, adapter_for(model), "auto", batch, 1024)
    assert got == want and not decoder.checked and "peft=prefix" in decoder.off
    with pytest.raises(EngineConfigError, match="engine.decode_cache=true: peft=prefix hands each attention its "
                                                "prefix through the same cache argument; use engine.decode_cache=auto"):
        decoded(model, adapter_for(model), "true", batch, 1024)


def test_offloaded_decoding_with_the_cache_after_an_update_is_resident_decoding_without_it():
    """Two steps with an update between: the second step's first walk applies the pending update
    (fused into its perturbation), its later walks rebuild the copies from the updated master. Blocks
    streamed through 2 device slots with the cache, against resident weights without it."""
    from distzo.engine import offload_engine

    got = {}
    for name, cache in (("offload", "true"), ("resident", "false")):
        model = random_model("llama", VOCAB, {"num_hidden_layers": 4}, 0, torch.float64)
        args = (model, adapter_for(model), TrainableParams.from_model(model), Directions(5))
        engine = (offload_engine(*args, slots=2, eps=3e-2, decode_cache=cache) if name == "offload"
                  else resident_engine(*args, eps=3e-2, decode_cache=cache))
        tokens = []
        for step in (1, 2):
            scores = engine.run_probes(decode_batch(seed=step), PLAN, step)
            tokens.append([scores[i].generated for i in range(len(PLAN))])
            engine.apply(step, [(0, 0.7), (1, -0.4)], 1e-1, 0.0)
        engine.close()
        got[name] = tokens
    assert got["offload"] == got["resident"]
    assert got["offload"][0] != got["offload"][1]
