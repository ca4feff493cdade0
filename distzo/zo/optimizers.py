"""ZO optimizers: what a step's projected gradients become in the weights, with which state (`optim.name`).

An estimator turns a step's losses into coefficients c_k (the projected gradient along z_k, over
q); the optimizer decides the update. Every rule here is element-wise and reads z_k of the step
being paid, so it runs chunk by chunk inside the engines' passes (the owed update fused into the
next perturbation), on any slice of a tensor, on any rank that owns the chunk; its state is one or
two float32 tensors shaped like the parameter (docs/optimizers.md).

| name | per element (g = sum_k c_k z_k, decay = 1 - lr wd where weight decay applies) | state |
|---|---|---|
| sgd | x <- x decay - sum_k (lr c_k) z_k (the MeZO update, unchanged) | none |
| momentum | x <- x decay - mu d; d <- mu d + sum_k (lr c_k) z_k; x <- x - sum_k (lr c_k) z_k | d |
| adam | m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2; x <- x decay - alpha m / (sqrt(v) / sqrt(1 - b2^t) + eps), alpha = lr / (1 - b1^t), t = step + 1 | m, v |
| sign | x <- x decay - lr sign(g) | none |
| fzoo | sgd's rule on coefficients c_k / std_k(g_k) (FZOO's step normalised by the spread of the losses) | none |

`momentum` is heavy-ball momentum in update units (d_t = mu d_{t-1} + lr_t g_t, theta_{t+1} = theta_t
decay - d_t: torch's SGD(momentum=mu, dampening=0) when lr is constant and there is no weight decay,
which torch folds into the buffer and distzo keeps out of it; ZO-Bench's ZO-SGD-MMT). Its
x receives the new terms exactly as sgd's does, so with mu = 0 the weights are sgd's bitwise.
`adam` is ZO-Adam (ZO-Bench: torch's Adam on g z) with decoupled weight decay (AdamW's). `sign` is
ZO-SignSGD (Liu et al. 2019, element-wise sign of the estimate). `fzoo` is FZOO's optimizer (Dang et
al., ICLR 2026): with estimator.difference=forward the q one-sided losses l_k = l_0 + eps g_k have
std eps std(g), so c_k / std(g) = (l_k - l_0) / (q std(l)), FZOO's coefficient (its code's form).

`UpdateRule.apply` is the rule's one definition in torch ops; the fused CPU kernel
(`distzo/native`, `distzo_chunk_rule`) performs the same float32 operations on every element, in
the same order, so the two agree bitwise. sgd and fzoo keep the engines' original path
(`rule() is None`).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from .estimators.base import StepResult

OPTIMIZERS = ("sgd", "momentum", "adam", "sign", "fzoo")
# Rule ids shared with the C kernel (distzo/native/kernels.c)
MOMENTUM, ADAM, SIGN = 1, 2, 3


def f32(x: float) -> float:
    """x rounded to the nearest float32 (what a kernel receives, and what torch casts a scalar to)."""
    return struct.unpack("f", struct.pack("f", float(x)))[0]


def correctly_rounded_sqrt(v: torch.Tensor) -> torch.Tensor:
    """sqrt(v) rounded once to v's dtype, as IEEE 754 (and C's sqrtf) defines it. torch's CPU sqrt of
    float32 is not always correctly rounded (about 0.5% of values differ by an ulp); the square root
    taken in float64 and rounded to float32 is (53 >= 2 * 24 + 2 bits: the double rounding is
    innocuous). CUDA's float sqrt is correctly rounded already."""
    if v.device.type == "cuda" or v.dtype == torch.float64:
        return v.sqrt()
    return v.double().sqrt_().to(v.dtype)


@dataclass(frozen=True)
class UpdateRule:
    """One step's element-wise update with state: the rule id, its float32 constants in the kernel's
    order, and whether a term's z is scaled by lr c_k (momentum) or by c_k (adam, sign)."""

    kind: int
    constants: tuple[float, ...]
    lr_terms: bool
    slots: int

    def term_scale(self, lr: float, c: float) -> float:
        return lr * c if self.lr_terms else c

    def apply(self, x: torch.Tensor, state: Sequence[torch.Tensor], terms: Sequence[tuple[torch.Tensor, bool]],
              decay: float | None) -> None:
        """The rule on float32 tensors, in place: x the master's elements, state this rule's slots
        over the same elements, terms [(|a_k| z_k, a_k < 0)] with a_k = term_scale(lr, c_k)."""
        if self.kind == MOMENTUM:
            (mu,), (d,) = self.constants, state
            if decay is not None:
                x.mul_(decay)
            if mu != 0.0:
                x.sub_(d * mu)
            d.mul_(mu)
            for z, add in terms:  # x moves by -a z, d accumulates +a z
                if add:
                    x.add_(z)
                    d.sub_(z)
                else:
                    x.sub_(z)
                    d.add_(z)
            return
        g = torch.zeros_like(x)
        for z, add in terms:  # g = sum_k c_k z_k
            g.sub_(z) if add else g.add_(z)
        if self.kind == ADAM:
            b1, omb1, b2, omb2, alpha, inv_bc2s, eps = self.constants
            m, v = state
            m.mul_(b1).add_(g * omb1)
            v.mul_(b2).add_(g.mul(g).mul_(omb2))
            if decay is not None:
                x.mul_(decay)
            x.sub_(m.mul(alpha).div_(correctly_rounded_sqrt(v).mul_(inv_bc2s).add_(eps)))
        elif self.kind == SIGN:
            (lr,) = self.constants
            if decay is not None:
                x.mul_(decay)
            torch.where(g > 0, x - lr, torch.where(g < 0, x + lr, x), out=x)
        else:
            raise ValueError(f"unknown update rule {self.kind}")


class Optimizer:
    """ZO-SGD, the base of every optimizer (see the module docstring).

    slots: the per-element float32 state tensors, by name. keys: the optimizer's own `optim.*`
    settings (they join the resume fingerprint). state_from_trajectory: its state at step t is a
    function of the trajectory's steps before t (zero state at step 0), so `replay` can rebuild it
    from the trajectory alone."""

    name = "sgd"
    slots: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()
    state_from_trajectory = True

    @classmethod
    def from_config(cls, cfg) -> "Optimizer":
        return cls()

    def coefficients(self, result: StepResult) -> tuple[tuple[int, float], ...]:
        """The coefficients the update applies (and the trajectory logs) for a step's estimate."""
        return result.coefficients

    def rule(self, step: int, lr: float, weight_decay: float) -> UpdateRule | None:
        """Step `step`'s element-wise rule, or None for sgd's update (the engines' original path)."""
        return None

    def state_bytes(self, numel: int) -> int:
        """Bytes of one copy of the state for `numel` trainable elements."""
        return 4 * len(self.slots) * numel

    def describe(self) -> str:
        return self.name


class SGD(Optimizer):
    pass


class Momentum(Optimizer):
    name = "momentum"
    slots = ("momentum",)
    keys = ("momentum",)

    def __init__(self, momentum: float = 0.9):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum {momentum} outside [0, 1)")
        self.mu = float(momentum)

    @classmethod
    def from_config(cls, cfg) -> "Momentum":
        return cls(cfg.momentum)

    def rule(self, step: int, lr: float, weight_decay: float) -> UpdateRule:
        return UpdateRule(MOMENTUM, (f32(self.mu),), True, 1)

    def describe(self) -> str:
        return f"momentum (mu {self.mu:g})"


class Adam(Optimizer):
    name = "adam"
    slots = ("exp_avg", "exp_avg_sq")
    keys = ("beta1", "beta2", "adam_eps")

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and eps > 0):
            raise ValueError(f"adam betas ({beta1}, {beta2}) outside [0, 1) or eps {eps} <= 0")
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)

    @classmethod
    def from_config(cls, cfg) -> "Adam":
        return cls(cfg.beta1, cfg.beta2, cfg.adam_eps)

    def rule(self, step: int, lr: float, weight_decay: float) -> UpdateRule:
        t = step + 1  # the update's number: bias corrections are a function of the step alone
        alpha = lr / (1.0 - self.beta1 ** t)
        inv_bc2s = 1.0 / math.sqrt(1.0 - self.beta2 ** t)
        return UpdateRule(ADAM, tuple(f32(c) for c in (self.beta1, 1.0 - self.beta1, self.beta2, 1.0 - self.beta2,
                                                       alpha, inv_bc2s, self.eps)), False, 2)

    def describe(self) -> str:
        return f"adam (betas {self.beta1:g}, {self.beta2:g}, eps {self.eps:g})"


class Sign(Optimizer):
    name = "sign"

    def rule(self, step: int, lr: float, weight_decay: float) -> UpdateRule:
        return UpdateRule(SIGN, (f32(lr),), False, 0)


class FZOO(Optimizer):
    """FZOO's step: the estimator's coefficients divided by the spread (population standard
    deviation) of the step's projected gradients, i.e. of its one-sided losses over eps. A step
    whose losses all tie has no spread and does not move (FZOO's code divides by zero there)."""

    name = "fzoo"

    def coefficients(self, result: StepResult) -> tuple[tuple[int, float], ...]:
        g = torch.tensor(result.grads, dtype=torch.float64)
        spread = float(g.std(unbiased=False)) if g.numel() > 1 else 0.0
        if not spread > 0.0:
            return tuple((k, 0.0) for k, _ in result.coefficients)
        return tuple((k, c / spread) for k, c in result.coefficients)


OPTIMIZER_TYPES: dict[str, type[Optimizer]] = {"sgd": SGD, "momentum": Momentum, "adam": Adam, "sign": Sign,
                                               "fzoo": FZOO}


def optimizer_type(name: str) -> type[Optimizer]:
    return OPTIMIZER_TYPES[str(name)]


def build_optimizer(cfg) -> Optimizer:
    """The optimizer an `optim` config describes (`optim.name`, default sgd)."""
    return optimizer_type(getattr(cfg, "name", "sgd") or "sgd").from_config(cfg)
