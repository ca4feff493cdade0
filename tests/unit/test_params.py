"""The trainable set: canonical order, tied weights once, MeZO's no-decay rule."""

import torch

from distzo.models.loading import random_model
from distzo.zo.directions import param_key
from distzo.zo.params import TrainableParams


def test_tied_weights_appear_once_under_their_first_name():
    model = random_model("llama", 500, {}, 0, torch.float32)
    params = TrainableParams.from_model(model)
    emb = params.get("model.embed_tokens.weight")
    assert emb is params.get("lm_head.weight") and emb.aliases == ("lm_head.weight",)
    assert len(params) == len({id(p.tensor) for p in params})
    assert params.numel() == sum(p.numel() for p in model.parameters())  # parameters() dedups too
    assert emb.key == param_key("model.embed_tokens.weight")


def test_untied_head_is_its_own_parameter():
    model = random_model("qwen2", 500, {}, 0, torch.float32)
    params = TrainableParams.from_model(model)
    assert params.get("lm_head.weight") is not params.get("model.embed_tokens.weight")


def test_no_decay_for_norms_and_biases():
    model = random_model("opt", 500, {}, 0, torch.float32)
    params = TrainableParams.from_model(model)
    no_decay = {p.name for p in params if not p.decay}
    assert "model.decoder.final_layer_norm.weight" in no_decay
    assert "model.decoder.layers.0.self_attn.q_proj.bias" in no_decay
    assert "model.decoder.layers.0.self_attn.q_proj.weight" not in no_decay
    llama = TrainableParams.from_model(random_model("llama", 500, {}, 0, torch.float32))
    assert not llama.get("model.norm.weight").decay  # MeZO's name rule would decay this one


def test_frozen_parameters_are_excluded():
    model = random_model("llama", 500, {}, 0, torch.float32)
    model.requires_grad_(False)
    model.model.norm.weight.requires_grad_(True)
    assert [p.name for p in TrainableParams.from_model(model)] == ["model.norm.weight"]
