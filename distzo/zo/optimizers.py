"""ZO optimizers: what a step's projected gradients become in the weights, with which state (`optim.name`).

An estimator turns a step's losses into coefficients c_k (the projected gradient along z_k, over
q); the optimizer decides the update. Every optimizer here is element-wise and reads z_k of the step
whose update it applies, so it runs chunk by chunk inside the engines' passes (the pending update
fused into the next perturbation), on any slice of a tensor, on any rank that owns the chunk; its
state is float32 tensors shaped like the parameter, or a few host numbers (meazo), or none
(docs/optimizers.md).

| name | per element (g = sum_k c_k z_k, decay = 1 - lr wd where weight decay applies) | state |
|---|---|---|
| sgd | x <- x decay - sum_k (lr c_k) z_k (the MeZO update) | none |
| momentum | x <- x decay - mu d; d <- mu d + sum_k (lr c_k) z_k; x <- x - sum_k (lr c_k) z_k | d |
| adam | m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2; x <- x decay - alpha m / (sqrt(v) / sqrt(1 - b2^t) + eps), alpha = lr / (1 - b1^t), t = step + 1 | m, v |
| sign | x <- x decay - lr sign(g) | none |
| fzoo | sgd's rule on coefficients c_k / std_k(g_k) (FZOO's step normalised by the spread of the losses) | none |
| hizoo | H <- (1 - alpha) H + alpha d H z^2; x <- x decay - lr c z / sqrt(H), d = abs(L+ + L- - 2 L0) / (2 eps^2); the probes are x +- eps z / sqrt(H) | H (starts at 1) |
| meazo | v <- b2 v + (1 - b2) mean_k g_k^2 (t steps); sgd's rule on coefficients c_k / (sqrt(v / (1 - b2^t)) + eps) | v and t: two numbers, not per element |

`momentum` is heavy-ball momentum in update units (d_t = mu d_{t-1} + lr_t g_t, theta_{t+1} = theta_t
decay - d_t: torch's SGD(momentum=mu, dampening=0) when lr is constant and there is no weight decay,
which torch folds into the buffer and distzo keeps out of it; ZO-Bench's ZO-SGD-MMT). Its
x receives the new terms exactly as sgd's does, so with mu = 0 the weights are sgd's bitwise.
`adam` is ZO-Adam (ZO-Bench: torch's Adam on g z) with decoupled weight decay (AdamW's). `sign` is
ZO-SignSGD (Liu et al. 2019, element-wise sign of the estimate). `fzoo` is FZOO's optimizer (Dang et
al., ICLR 2026): with estimator.difference=forward the q one-sided losses l_k = l_0 + eps g_k have
std eps std(g), so c_k / std(g) = (l_k - l_0) / (q std(l)), FZOO's coefficient (its code's form).
`hizoo` is HiZOO (Zhao et al., ICLR 2025) as its authors' code runs it: a diagonal Hessian estimate H
(one float32 slot, ones at the start) both shapes the step's directions (the probes read
x +- eps z / sqrt(H), `shapes_directions`) and preconditions the update; it reads the curvature d
of three losses a step (estimator.clean=true: L0 = L(x) beside L+-), carried in the step's
coefficients as the entry `(CURVATURE, d)` so that resume and replay re-apply it like any other.
`meazo` is MEAZO (Dbouk et al. 2026, "On Adaptivity in Zeroth-Order Optimization"): Adam's
second-moment normalisation kept as one scalar, a running mean of the squared projected gradients,
because a ZO estimate's per-element second moment holds nothing beyond that scale (z^2 is noise
around 1); its state is `scalars`, host numbers the same on every rank, advanced by each step's
projected gradients (`advance`), and the trajectory logs the normalised coefficients.

Each optimizer is one class, registered by name (`@register("optimizer", name)`, distzo.registry):
its rule in torch ops (`update`, the definition), its state slots, its settings (a dataclass
`Settings` beside it, extending `OptimSettings`: `optim.<field>`) and its configuration checks
(`check`). The engines call nothing but a step's `Rule`. Where a rule has a case in the fused CPU
kernel (`kernel`, `distzo_chunk_rule` in distzo/native/kernels.c), that case performs the same
float32 operations on every element in the same order, so the two agree bitwise
(tests/unit/test_optimizers.py checks every registered rule); a rule without one runs on torch ops
everywhere. Adding an element-wise optimizer is one class (here, or in a module of your own named by
DISTZO_PLUGINS), plus a kernel case if the fused CPU path should run it.
"""  # noqa: E501 (a markdown table above: its rows cannot wrap)

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields
from typing import ClassVar, Mapping, Sequence

import torch

from ..config.schema import Config, OptimSettings, setting
from ..errors import ConfigError
from ..registry import register, registry
from .estimators import estimator_type
from .estimators.base import StepResult

# A term of an update: (|a_k| z_k as float32 over the chunk's elements, a_k < 0), a_k = Rule.term_scale(c_k).
Term = tuple[torch.Tensor, bool]


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


def estimate(terms: Sequence[Term], like: torch.Tensor) -> torch.Tensor:
    """g = sum_k a_k z_k from a rule's terms, in float32, in the terms' order."""
    g = torch.zeros_like(like)
    for z, add in terms:
        g.sub_(z) if add else g.add_(z)
    return g


@dataclass(frozen=True)
class Rule:
    """One step of an optimizer's element-wise update: the optimizer and its float32 constants for
    that step. What the engines' chunk pass (distzo.engine.chunkpass) calls."""

    optimizer: Optimizer
    constants: tuple[float, ...]
    lr: float

    @property
    def slots(self) -> int:
        return len(self.optimizer.slots)

    @property
    def kernel(self) -> int | None:
        return self.optimizer.kernel

    @property
    def separable(self) -> bool:
        return self.optimizer.separable

    def term_scale(self, c: float) -> float:
        """a_k: z_k enters the update scaled by lr c_k (or by c_k for a rule that says so)."""
        return self.optimizer.term_scale(c, self.lr)

    def terms(self, coefficients: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
        """The update's (query, a_k) terms for the step's coefficients (`Optimizer.terms`)."""
        return self.optimizer.terms(coefficients, self.lr)

    def apply(self, x: torch.Tensor, state: Sequence[torch.Tensor], terms: Sequence[Term],
              decay: float | None) -> None:
        """The rule on float32 tensors, in place: x the master's elements, state the optimizer's
        slots over the same elements, terms [(|a_k| z_k, a_k < 0)]."""
        self.optimizer.update(x, state, terms, decay, self.constants)


class Optimizer:
    """An element-wise ZO optimizer (see the module docstring); the base holds what they share.

    name: its `optim.name` (set by `register`). Settings: its settings, `OptimSettings` extended by
    its own fields (`optim.<field>`; they join the resume fingerprint). slots: its per-element
    float32 state tensors, by name. kernel: its case in the fused CPU kernel (None: torch ops).
    lr_terms: a term's z is scaled by lr c_k (False: by c_k). separable: the terms change x one
    after another and change nothing else, so a pass may apply them in several kernel calls (sgd).
    state_from_trajectory: its state at step t is a function of the trajectory's steps before t
    (the initial state at step 0), so `replay` can rebuild it from the trajectory alone.
    initial: the value every state element starts at (0; HiZOO's Hessian starts at 1).
    shapes_directions: its state shapes the step's directions: a probe reads x + s `perturbation`(eps
    z, state) instead of x + s eps z, so every pass that writes working copies reads the state (and
    its kernel case, if any, shapes the copies it writes).
    max_terms: the most directions one update takes (None: any number).
    scalars: its state that is not per element: host numbers (float64) that each applied step's
    projected gradients advance (`advance`; the same on every rank, since they follow from the
    exchanged losses) and that `coefficients` reads (MEAZO's second moment). Snapshots carry them
    (`scalar_state`); resume advances them again through the logged steps it re-applies."""

    name: ClassVar[str]
    Settings: ClassVar[type] = OptimSettings
    slots: ClassVar[tuple[str, ...]] = ()
    kernel: ClassVar[int | None] = None
    lr_terms: ClassVar[bool] = True
    separable: ClassVar[bool] = False
    state_from_trajectory: ClassVar[bool] = True
    initial: ClassVar[float] = 0.0
    shapes_directions: ClassVar[bool] = False
    max_terms: ClassVar[int | None] = None
    scalars: ClassVar[tuple[str, ...]] = ()

    def __init__(self, settings: OptimSettings | None = None):
        """settings: the `optim` section (None: this optimizer's defaults)."""
        self.settings = settings if settings is not None else self.Settings(name=self.name)
        self.scalar: dict[str, float] = dict.fromkeys(self.scalars, 0.0)

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Rules between this optimizer and the rest of a run's configuration (raises ConfigError)."""

    def constants(self, step: int, lr: float) -> tuple[float, ...]:
        """Step `step`'s float32 constants of the rule, in the kernel's order."""
        return ()

    def update(self, x: torch.Tensor, state: Sequence[torch.Tensor], terms: Sequence[Term], decay: float | None,
               constants: Sequence[float]) -> None:
        """The rule's definition in torch ops (see `Rule.apply`)."""
        raise NotImplementedError

    def rule(self, step: int, lr: float, weight_decay: float, coefficients: Sequence[tuple[int, float]] = ()) -> Rule:
        """Step `step`'s rule (coefficients: the step's, for a rule whose constants read them)."""
        return Rule(self, tuple(f32(c) for c in self.constants(step, lr)), lr)

    def advance(self, grads: Sequence[float]) -> None:
        """An applied step's projected gradients advance the `scalars` (nothing where there are none).
        Training calls it once per step whose update it applies, before `coefficients`; resume once
        per logged step it re-applies."""

    def coefficients(self, result: StepResult) -> tuple[tuple[int, float], ...]:
        """The coefficients the update applies (and the trajectory logs) for a step's estimate."""
        return result.coefficients

    def scalar_state(self) -> dict[str, torch.Tensor]:
        """The `scalars` as float64 tensors of one element (what a snapshot writes)."""
        return {k: torch.tensor([v], dtype=torch.float64) for k, v in self.scalar.items()}

    def load_scalar_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Continue from a snapshot's `scalar_state`."""
        if set(tensors) != set(self.scalars):
            raise ValueError(f"optimizer {self.name} keeps the scalars {sorted(self.scalars)}, not {sorted(tensors)}")
        self.scalar = {k: float(tensors[k].reshape(())) for k in self.scalars}

    def term_scale(self, c: float, lr: float) -> float:
        """a_k for a coefficient c_k: lr c_k, or c_k where `lr_terms` is False."""
        return lr * c if self.lr_terms else c

    def terms(self, coefficients: Sequence[tuple[int, float]], lr: float) -> list[tuple[int, float]]:
        """The update's terms (query k, a_k): z_k enters scaled by |a_k| (`term_scale`); a zero
        coefficient adds nothing."""
        return [(k, self.term_scale(c, lr)) for k, c in coefficients if c != 0.0]

    def perturbation(self, scaled_z: torch.Tensor, state: Sequence[torch.Tensor]) -> torch.Tensor:
        """What a probe adds to (or subtracts from) x, given eps z (float32) and the state over the
        same elements; a `shapes_directions` optimizer's own (the others never call it)."""
        return scaled_z

    def state_bytes(self, numel: int) -> int:
        """Bytes of one copy of the state for `numel` trainable elements."""
        return 4 * len(self.slots) * numel

    def describe(self) -> str:
        return self.name


@register("optimizer", "sgd")
class SGD(Optimizer):
    """ZO-SGD: x <- x decay - sum_k (lr c_k) z_k, each term one rounded operation, in order."""

    kernel = 0
    separable = True

    def update(self, x, state, terms, decay, constants) -> None:
        if decay is not None:
            x.mul_(decay)
        for z, add in terms:
            x.add_(z) if add else x.sub_(z)


@register("optimizer", "momentum")
class Momentum(Optimizer):
    slots = ("momentum",)
    kernel = 1

    @dataclass
    class Settings(OptimSettings):
        mu: float = setting(0.9, ">= 0 and < 1", "the momentum (heavy ball, d <- mu d + lr g; 0 gives sgd's weights)")

    def __init__(self, settings: Settings | None = None):
        super().__init__(settings)
        self.mu = float(self.settings.mu)
        if not 0.0 <= self.mu < 1.0:
            raise ValueError(f"momentum {self.mu} outside [0, 1)")

    def constants(self, step: int, lr: float) -> tuple[float, ...]:
        return (self.mu,)

    def update(self, x, state, terms, decay, constants) -> None:
        (mu,), (d,) = constants, state
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

    def describe(self) -> str:
        return f"momentum (mu {self.mu:g})"


@register("optimizer", "adam")
class Adam(Optimizer):
    slots = ("exp_avg", "exp_avg_sq")
    kernel = 2
    lr_terms = False

    @dataclass
    class Settings(OptimSettings):
        beta1: float = setting(0.9, ">= 0 and < 1", "the first moment's decay")
        beta2: float = setting(0.999, ">= 0 and < 1", "the second moment's decay")
        eps: float = setting(1e-8, "> 0", "added to the bias-corrected sqrt(v)")

    def __init__(self, settings: Settings | None = None):
        super().__init__(settings)
        s = self.settings
        self.beta1, self.beta2, self.eps = float(s.beta1), float(s.beta2), float(s.eps)
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0 and self.eps > 0):
            raise ValueError(f"adam betas ({self.beta1}, {self.beta2}) outside [0, 1) or eps {self.eps} <= 0")

    def constants(self, step: int, lr: float) -> tuple[float, ...]:
        t = step + 1  # the update's number: bias corrections are a function of the step alone
        alpha = lr / (1.0 - self.beta1 ** t)
        inv_bc2s = 1.0 / math.sqrt(1.0 - self.beta2 ** t)
        return (self.beta1, 1.0 - self.beta1, self.beta2, 1.0 - self.beta2, alpha, inv_bc2s, self.eps)

    def update(self, x, state, terms, decay, constants) -> None:
        b1, omb1, b2, omb2, alpha, inv_bc2s, eps = constants
        m, v = state
        g = estimate(terms, x)
        m.mul_(b1).add_(g * omb1)
        v.mul_(b2).add_(g.mul(g).mul_(omb2))
        if decay is not None:
            x.mul_(decay)
        x.sub_(m.mul(alpha).div_(correctly_rounded_sqrt(v).mul_(inv_bc2s).add_(eps)))

    def describe(self) -> str:
        return f"adam (betas {self.beta1:g}, {self.beta2:g}, eps {self.eps:g})"


@register("optimizer", "sign")
class Sign(Optimizer):
    kernel = 3
    lr_terms = False

    def constants(self, step: int, lr: float) -> tuple[float, ...]:
        return (lr,)

    def update(self, x, state, terms, decay, constants) -> None:
        (lr,) = constants
        g = estimate(terms, x)
        if decay is not None:
            x.mul_(decay)
        torch.where(g > 0, x - lr, torch.where(g < 0, x + lr, x), out=x)


@register("optimizer", "fzoo")
class FZOO(SGD):
    """FZOO's step: the estimator's coefficients divided by the spread (population standard
    deviation) of the step's projected gradients, i.e. of its one-sided losses over eps, then sgd's
    rule. A step whose losses all tie has no spread and does not move (FZOO's code divides by zero
    there)."""

    @classmethod
    def check(cls, cfg: Config) -> None:
        est = cfg.estimator
        one_sided = "forward" in estimator_type(est.name).differences
        if not one_sided or est.difference != "forward":
            fix = ("use estimator=mezo estimator.difference=forward estimator.q=8" if not one_sided
                   else "add estimator.difference=forward estimator.q=8")
            raise ConfigError(f"optim.name=fzoo normalises the step by the spread of one-sided losses; "
                              f"estimator={est.name} with estimator.difference={est.difference} does not make "
                              f"them: {fix}")
        if est.q < 2:
            raise ConfigError(f"optim.name=fzoo normalises the step by the spread of the step's estimator.q losses; "
                              f"estimator.q={est.q} has none: use estimator.q >= 2 (FZOO uses 8)")

    def coefficients(self, result: StepResult) -> tuple[tuple[int, float], ...]:
        g = torch.tensor(result.grads, dtype=torch.float64)
        spread = float(g.std(unbiased=False)) if g.numel() > 1 else 0.0
        if not spread > 0.0:
            return tuple((k, 0.0) for k, _ in result.coefficients)
        return tuple((k, c / spread) for k, c in result.coefficients)


CURVATURE = -2  # the coefficient entry (CURVATURE, d) of a HiZOO step: its curvature, not a direction


@register("optimizer", "hizoo")
class HiZOO(Optimizer):
    """HiZOO: a diagonal Hessian estimate H, updated from the step's curvature, scales the
    directions and preconditions the update (the module docstring's table; docs/optimizers.md).
    Per element, with z the step's direction, c its projected gradient and d = |L+ + L- - 2 L0| /
    (2 eps^2), in float32, each product rounded in this order:

        H <- H (1 - alpha) + ((z z) H) (alpha d)
        x <- x decay - (z (lr c)) / sqrt(H)                 (the updated H)
        probe: x +- (eps z) / sqrt(H)                      (the updated x and H)

    Its authors' code takes d's absolute value of the scalar and z^2 (not the paper's z^2 - 1), and
    probes with the H of the previous step's update; so does this. It skips their fourth forward
    pass (the loss after the update, logged only): the clean probe's loss is the logged loss."""

    slots = ("hessian",)
    kernel = 4
    lr_terms = False
    initial = 1.0
    shapes_directions = True
    max_terms = 1

    @dataclass
    class Settings(OptimSettings):
        alpha: float = setting(1e-6, ">= 0 and < 1", "the Hessian's smoothing: H <- (1 - alpha) H + alpha d H z^2 "
                                                     "(0 keeps H at 1: MeZO's steps with one more forward pass)")

    def __init__(self, settings: Settings | None = None):
        super().__init__(settings)
        self.alpha = float(self.settings.alpha)
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"hizoo alpha {self.alpha} outside [0, 1)")

    @classmethod
    def check(cls, cfg: Config) -> None:
        est = cfg.estimator
        if "clean" not in {f.name for f in fields(estimator_type(est.name).Settings)}:  # no curvature to read
            raise ConfigError(f"optim.name=hizoo scales MeZO's directions by its Hessian estimate; "
                              f"estimator={est.name} draws its own: use estimator=mezo estimator.clean=true")
        if not getattr(est, "clean", False):
            raise ConfigError("optim.name=hizoo reads the curvature of three losses a step, L(x), L(x + eps z) and "
                              "L(x - eps z): add estimator.clean=true")
        if est.q != 1:
            raise ConfigError(f"optim.name=hizoo updates its Hessian from one direction a step; estimator.q={est.q}: "
                              "use estimator.q=1")

    def coefficients(self, result: StepResult) -> tuple[tuple[int, float], ...]:
        if len(result.curvatures) != 1 or len(result.coefficients) != 1:
            raise ValueError("optim.name=hizoo needs one direction and its curvature a step (estimator=mezo "
                             "estimator.clean=true estimator.q=1)")
        return (*result.coefficients, (CURVATURE, abs(result.curvatures[0])))

    def rule(self, step: int, lr: float, weight_decay: float, coefficients: Sequence[tuple[int, float]] = ()) -> Rule:
        c = sum(v for k, v in coefficients if k != CURVATURE)
        d = sum(v for k, v in coefficients if k == CURVATURE)
        return Rule(self, (f32(1.0 - self.alpha), f32(self.alpha * d), f32(lr * c)), lr)

    def terms(self, coefficients: Sequence[tuple[int, float]], lr: float) -> list[tuple[int, float]]:
        # z itself (scaled by 1, exactly): its square updates H even where c is zero
        return [(k, 1.0) for k, _ in coefficients if k != CURVATURE]

    def update(self, x, state, terms, decay, constants) -> None:
        keep, alpha_d, lr_c = constants
        (h,) = state
        if len(terms) > 1:
            raise RuntimeError("internal error: a hizoo update with more than one direction")
        if terms:
            z = terms[0][0]
            curved = z.mul(z).mul_(h).mul_(alpha_d)  # from H before this step's update
            h.mul_(keep).add_(curved)
        if decay is not None:
            x.mul_(decay)
        if terms:
            x.sub_(z.mul(lr_c).div_(correctly_rounded_sqrt(h)))

    def perturbation(self, scaled_z: torch.Tensor, state: Sequence[torch.Tensor]) -> torch.Tensor:
        return scaled_z / correctly_rounded_sqrt(state[0])

    def describe(self) -> str:
        return f"hizoo (alpha {self.alpha:g})"


@register("optimizer", "meazo")
class MEAZO(SGD):
    """MEAZO: sgd's rule on the estimator's coefficients divided by sqrt(v_hat) + eps, where v is a
    running mean of the squared projected gradients, one number for the whole model:

        v <- b2 v + (1 - b2) mean_k(g_k^2);  t <- t + 1;  v_hat = v / (1 - b2^t)
        c'_k = c_k / (sqrt(v_hat) + eps)

    in float64 on the host, identical on every rank. It is Adam's normalisation without Adam's 2 x d
    state: the element-wise second moment of an estimate g_k z_k is g_k^2 z^2, and z^2 is noise
    around 1, so a per-element v adds only noise to that one scale (Dbouk et al. 2026). The step
    lr c'_k z_k does not grow with the loss's scale: its lr is of Adam's order (the first step moves
    along each direction by about lr / q), not MeZO's. t counts the applied steps: a step skipped for
    non-finite losses leaves v and t as they were."""

    scalars = ("second_moment", "steps")

    @dataclass
    class Settings(OptimSettings):
        beta2: float = setting(0.999, ">= 0 and < 1", "the decay of the running mean of the squared projected "
                                                      "gradients")
        eps: float = setting(1e-8, "> 0", "added to the bias-corrected sqrt(v)")

    def __init__(self, settings: Settings | None = None):
        super().__init__(settings)
        self.beta2, self.eps = float(self.settings.beta2), float(self.settings.eps)
        if not (0.0 <= self.beta2 < 1.0 and self.eps > 0):
            raise ValueError(f"meazo beta2 {self.beta2} outside [0, 1) or eps {self.eps} <= 0")

    def advance(self, grads: Sequence[float]) -> None:
        if not grads:
            raise ValueError("optim.name=meazo needs the step's projected gradients")
        mean_square = math.fsum(g * g for g in grads) / len(grads)
        self.scalar["second_moment"] = self.beta2 * self.scalar["second_moment"] + (1.0 - self.beta2) * mean_square
        self.scalar["steps"] += 1.0

    def scale(self) -> float:
        """1 / (sqrt(v_hat) + eps): the coefficients' factor after the steps advanced so far."""
        t = self.scalar["steps"]
        if t < 1:
            raise RuntimeError("internal error: meazo's coefficients before a step advanced its second moment")
        v_hat = self.scalar["second_moment"] / (1.0 - self.beta2 ** t)
        return 1.0 / (math.sqrt(v_hat) + self.eps)

    def coefficients(self, result: StepResult) -> tuple[tuple[int, float], ...]:
        s = self.scale()
        return tuple((k, c * s) for k, c in result.coefficients)

    def describe(self) -> str:
        return f"meazo (beta2 {self.beta2:g}, eps {self.eps:g})"


def optimizer_type(name: str) -> type[Optimizer]:
    """The optimizer class `optim.name` names, among the registered ones and those your modules
    register ($DISTZO_PLUGINS, distzo.registry)."""
    return registry("optimizer").get(name)


def build_optimizer(settings: OptimSettings) -> Optimizer:
    """The optimizer the `optim` section describes (its name and settings)."""
    return optimizer_type(settings.name)(settings)
