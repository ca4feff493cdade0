"""P-RGE (Gao et al. 2024): SPSA over LoRA-FA's B matrices, every query and sign in one forward.

The estimate is MeZO's n-SPSA, g_k = (L(B + eps z_k) - L(B - eps z_k)) / (2 eps), with the update
B -= lr * mean_k(g_k z_k) (P-RGE Eq. 1, no extra scaling of lr with q) and every query on the same
batch. What differs is how the losses are computed: a rank replicates its data shard once per
probe it holds and runs them all as ONE forward, each LoRA layer applying its per-probe
copy of B with a batched matmul (the outer loop over queries and the inner loop over signs, P-RGE
§3.1-3.2), so the frozen weights are read once for all 2q probes. The engine does that when
`batched` is set; `prge.materialize=false` draws each layer's copies inside its forward.
"""

from __future__ import annotations

from ...config.schema import EstimatorConfig
from ...errors import ConfigError
from .spsa import SPSA


class PRGE(SPSA):
    name = "prge"
    batched = True
    streams_blocks = False  # LoRA-FA's B copies, stacked per probe (engine/stacked.py)
    decodes = False

    def __init__(self, eps: float = 1e-2, q: int = 1):
        super().__init__(eps=eps, q=q, difference="central")

    @classmethod
    def from_config(cls, cfg: EstimatorConfig) -> PRGE:
        return cls(eps=cfg.eps, q=cfg.q)

    @classmethod
    def check_config(cls, cfg: EstimatorConfig, peft_method: str) -> None:
        if peft_method != "lora_fa":
            raise ConfigError(f"estimator=prge perturbs LoRA-FA's B matrices only; add peft=lora_fa (now "
                              f"peft={peft_method})")
        if cfg.difference != "central":
            raise ConfigError("estimator=prge evaluates + and - of every query in one forward; it needs "
                              "estimator.difference=central")
