"""LoRA adapters in the Hugging Face PEFT format, so the ecosystem loads what distzo trained:
`peft.PeftModel.from_pretrained(stock_model, "<run>/final")`.

distzo's LoRA is PEFT's (y = W x + (alpha / r) B A x, no dropout in a ZO forward), so the export is a
renaming: each adapted layer `<name>` gives `base_model.model.<name>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r] (LoRA-FA's frozen A included: the product needs it), and
`adapter_config.json` names exactly those modules. For GPT-2's Conv1D layers (weight stored
[in, out]) the config says `fan_in_fan_out`, PEFT's flag for them; A and B keep their shapes.
Prefix tuning has no PEFT counterpart with the
same parameterisation and is kept in distzo's own format only.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

from .lora import is_conv1d, lora_layers

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def write_peft_lora(model: nn.Module, r: int, alpha: float, base_model: str | None, folder: Path) -> list[Path]:
    """Write the model's LoRA layers into `folder` as a PEFT adapter; returns the files written."""
    layers = lora_layers(model)
    tensors = {}
    for name, module in layers:
        tensors[f"base_model.model.{name}.lora_A.weight"] = module.lora_A.detach().to("cpu").contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = module.lora_B.detach().to("cpu").contiguous()
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": [name for name, _ in layers], "bias": "none",
        "fan_in_fan_out": any(is_conv1d(module) for _, module in layers),
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "base_model_name_or_path": base_model,
    }
    save_file(tensors, folder / PEFT_WEIGHTS, metadata={"format": "pt"})
    (folder / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [folder / PEFT_WEIGHTS, folder / PEFT_CONFIG]
