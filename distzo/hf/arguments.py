"""`ZOArguments`: the zeroth-order settings of a ZOTrainer run, the rest coming from transformers'
`TrainingArguments` (docs/hf.md).

Its fields come from distzo's registry (distzo.registry): besides the estimator's and optimizer's
names, every setting a registered estimator declares (`eps`, `q`, `rank`, ...) is a field of the same
name, and every setting of a registered optimizer is `optim_<field>` (`optim_mu`, `optim_beta2`, as
`optim.beta2` on the command line; the learning rate, weight decay and schedule are TrainingArguments').
Each defaults to None, which means the chosen component's own default: `ZOArguments(estimator="agzo")`
runs AGZO's defaults (eps 1e-4, the forward difference), as `estimator=agzo` does. A setting the chosen
component does not have is refused in one line. The class is built when distzo.hf is first imported,
after the modules of $DISTZO_PLUGINS, so your own components' settings are fields too (`overrides`
reaches anything else).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config.tables import owners, zo_argument_fields
from ..errors import ConfigError

log = logging.getLogger("distzo")
# ZOArguments' earlier fields -> the fields they are now
_EARLIER = {"momentum": ("optim_mu",), "adam_betas": ("optim_beta1", "optim_beta2"), "adam_eps": ("optim_eps",)}


@dataclass
class _ZOArgumentsBase:
    """The zeroth-order settings (see the module docstring and docs/hf.md): the rest comes from
    `TrainingArguments`.

    estimator: a registered estimator (mezo, prge, agzo, lozo, subzero, sparse_mezo, or your own);
    optimizer: a registered ZO optimizer (sgd, momentum, adam, sign, fzoo, hizoo, meazo, or your own). peft:
    distzo's trainable set (lora, lora_fa, prefix) for a plain model; None: the model's own trainable
    parameters (all of them, or a PEFT model's adapter), or the one trainable set the estimator runs on
    (prge: lora_fa). offload: none or cpu (ZO2: blocks in host memory); mesh: P x D over the launched
    processes (null: 1 x world size). device: auto, cpu or cuda. overrides: any further distzo setting,
    as `key=value` strings (`engine.compute=bf16`). The estimator's settings are fields of their own
    names, the optimizer's `optim_<name>`; None: the component's own default."""

    estimator: str = "mezo"
    optimizer: str = "sgd"
    peft: str | None = None
    offload: str = "none"
    mesh: str | None = None
    device: str = "auto"
    overrides: list[str] = field(default_factory=list)
    # The earlier spellings of the optimizers' settings, still read: optim_mu, optim_beta1/beta2, optim_eps.
    momentum: float | None = None
    adam_betas: list[float] | None = None
    adam_eps: float | None = None


def _build() -> type:
    # typing.Optional, which every HfArgumentParser reads (not all read `X | None` built at run time)
    extra = [(key, Optional[kind], dataclasses.field(default=None))  # noqa: UP045
             for key, (_, _, kind) in zo_argument_fields().items()]
    cls = dataclasses.make_dataclass("ZOArguments", extra, bases=(_ZOArgumentsBase,))
    cls.__module__, cls.__doc__ = "distzo.hf", _ZOArgumentsBase.__doc__
    return cls


ZOArguments = _build()


def setting_overrides(args: Any) -> list[str]:
    """The overrides selecting `args`' estimator and optimizer and setting what it sets of theirs (in
    the components' own keys: `estimator.rank=2`, `optim.beta2=0.99`). ConfigError for a setting the
    chosen component does not have."""
    from ..config.compose import override_key

    chosen = {"estimator": args.estimator, "optim": args.optimizer}
    named = {override_key(o).split(".")[0] for o in args.overrides
             if override_key(o) in ("estimator", "estimator.name", "optim", "optim.name")}
    out = [f"{group}={name}" for group, name in chosen.items() if group not in named]  # `overrides` choose last
    given = {key: getattr(args, key, None) for key in zo_argument_fields()}
    for old, new in _EARLIER.items():
        value = getattr(args, old, None)
        if value is not None:
            log.warning("ZOArguments(%s=...) is spelled %s now (the old spelling is still read)", old,
                        " and ".join(new))
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            given.update({key: v for key, v in zip(new, values) if given.get(key) is None})
    for key, (group, name, _) in zo_argument_fields().items():
        value = given.get(key)
        if value is None:
            continue
        have = owners(group, name)
        if chosen[group] not in have:
            raise ConfigError(f"ZOArguments({key}=...) is a setting of {group}={' or '.join(have)}, not of "
                              f"{group}={chosen[group]}; drop it or choose one of those")
        if isinstance(value, (list, tuple)):
            value = "[" + ",".join(map(str, value)) + "]"
        out.append(f"{group}.{name}={getattr(value, 'value', value)}")
    return out
