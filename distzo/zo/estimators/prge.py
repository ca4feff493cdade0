"""P-RGE (Gao et al. 2024): SPSA over LoRA-FA's B matrices, every query and sign in one forward.

The estimate is MeZO's n-SPSA, g_k = (L(B + eps z_k) - L(B - eps z_k)) / (2 eps), with the update
B -= lr * mean_k(g_k z_k) (P-RGE Eq. 1, no extra scaling of lr with q) and every query on the same
batch. What differs is how the losses are computed: a rank replicates its data shard once per
probe it holds and runs them all as ONE forward, each LoRA layer applying its per-probe
copy of B with a batched matmul (the outer loop over queries and the inner loop over signs, P-RGE
§3.1-3.2), so the frozen weights are read once for all 2q probes. The engine does that for a
`stacked` estimator (distzo.engine.stacked). Paper: q in {1..16} at q x batch = 16, eps 1e-2, LoRA r 16.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config.schema import Config, EstimatorSettings, setting
from ...errors import ConfigError
from ...registry import register
from .spsa import SPSA


@register("estimator", "prge")
class PRGE(SPSA):
    stacked = True
    streams_blocks = False  # LoRA-FA's B copies, stacked per probe (engine/stacked.py)
    decodes = False
    differences = ("central",)
    peft_methods = ("lora_fa",)

    @dataclass
    class Settings(EstimatorSettings):
        eps: float = setting(1e-2, "> 0", "the perturbation scale (eps)")
        q: int = setting(4, ">= 1", "directions (queries) per step, all in one forward")
        materialize: bool = setting(True, doc="stack a block's B copies before it runs; false: each LoRA layer "
                                    "draws its copies inside its forward and drops them (P-RGE §3.2's memory "
                                    "option; bitwise the same copies)")

    def __init__(self, eps: float = 1e-2, q: int = 1, materialize: bool = True):
        super().__init__(eps=eps, q=q, difference="central")
        self.materialize = bool(materialize)

    @classmethod
    def from_settings(cls, s: Settings) -> PRGE:
        return cls(eps=s.eps, q=s.q, materialize=s.materialize)

    @classmethod
    def check(cls, cfg: Config) -> None:
        peft = str(cfg.peft.method)
        if peft != "lora_fa":
            raise ConfigError(f"estimator=prge perturbs LoRA-FA's B matrices only; add peft=lora_fa (now peft={peft})")
        if cfg.estimator.difference != "central":
            raise ConfigError("estimator=prge evaluates + and - of every query in one forward; it needs "
                              "estimator.difference=central")
