"""Composing a run configuration: the packaged presets (plus your own config directories) with
command-line style overrides, through Hydra's compose API. Every composition mistake becomes one
ConfigError line naming the key and the fix (`explain`), including values Hydra's override grammar
cannot read, for which the quoted form to type is shown."""

from __future__ import annotations

import copy
import os
import re
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from hydra.core.config_store import ConfigStore

from ..errors import ConfigError
from ..registry import registry
from .legacy import upgrade_overrides, upgrade_saved
from .schema import Config, EstimatorSettings, OptimSettings

CONFIG_PATH_ENV = "DISTZO_CONFIG_PATH"  # your own config directories, searched after the presets
GROUPS = ("model", "task", "estimator", "optim", "offload", "logger", "peft")
# Hydra presets that plugins bring (distzo's own hydra/launcher=distzo_slurm builds on submitit's).
PLUGINS = {("hydra/launcher", "submitit_slurm"): "hydra-submitit-launcher",
           ("hydra/launcher", "distzo_slurm"): "hydra-submitit-launcher",
           ("hydra/launcher", "submitit_local"): "hydra-submitit-launcher",
           ("hydra/sweeper", "optuna"): "hydra-optuna-sweeper"}


def register_configs() -> None:
    """Register the schemas so that YAML presets are checked against them, and each registered
    estimator's and optimizer's settings as the options of the `estimator` and `optim` config groups
    (`estimator=agzo`: AGZO's settings with their defaults; distzo.registry). Once per process for
    the same components: Hydra's ConfigStore keeps what was stored, and storing it again cost each
    composition about a quarter of its time (a command composes three to five times)."""
    global _registered
    components = tuple((point, name, cls) for point in SETTINGS_BASES for name, cls in registry(point).items())
    if components == _registered:
        return
    store = ConfigStore.instance()
    # The top-level schema types every group's node, so each preset YAML merged into `model` or
    # `task` is checked against its dataclass without per-group schema entries.
    store.store(name="distzo_schema", node=Config)
    for point, name, cls in components:
        try:
            node = component_settings(point, name, cls, SETTINGS_BASES[point])
        except ValueError as exc:  # a plugin's mistake: one line naming it, whichever component a run chooses
            raise ConfigError(f"{exc}; fix it, or remove its module from DISTZO_PLUGINS") from None
        store.store(group=registry(point).point.group, name=name, node=node)
    _registered = components


_registered: tuple | None = None  # the (point, name, class) of every component register_configs stored


SETTINGS_BASES = {"estimator": EstimatorSettings, "optimizer": OptimSettings}


def component_settings(point: str, name: str, cls: type, base: type) -> Any:
    """The settings of a registered estimator or optimizer with their defaults (its class's
    `Settings`, which extends its point's base); a ValueError for a component that declares them
    wrongly (a plugin author's mistake, named when the plugin is first used)."""
    from .checks import check_range

    settings = getattr(cls, "Settings", base)
    if not (isinstance(settings, type) and is_dataclass(settings) and issubclass(settings, base)):
        raise ValueError(f"{point} {name} ({cls.__module__}.{cls.__qualname__}): its Settings must be a dataclass "
                         f"extending {base.__module__}.{base.__qualname__}")
    for f in fields(settings):
        if "range" in f.metadata:
            check_range(f.metadata["range"])
    return settings(name=name)


def component_of(cfg_section: Any, point: str) -> type:
    """The registered class a configuration section names (`cfg.estimator`, `cfg.optim`): ConfigError
    when the section's settings are not that component's (its name set by hand inside a config file
    instead of selecting the group option)."""
    cls = registry(point).get(cfg_section.name)
    settings = getattr(cls, "Settings", SETTINGS_BASES[point])
    if type(cfg_section) is not settings:
        group = registry(point).point.group
        raise ConfigError(f"{group}.name={cfg_section.name} is set without {cls.name}'s settings; select it as a "
                          f"config group option: {group}={cls.name}")
    return cls


def typed(cfg: Any) -> Config:
    """A composed configuration as the schema's dataclasses (`Config`, its sections `ModelConfig`,
    `TaskConfig`, ..., the estimator's and optimizer's own `Settings`; choices as their Enums): what
    every layer below the public entry points receives. Hydra's own `hydra` section, if present, is
    not part of the schema. Idempotent."""
    if isinstance(cfg, Config):
        return cfg
    from omegaconf import OmegaConf

    if OmegaConf.get_type(cfg) is Config:
        # A composition (typed by distzo_schema): each section converts on its own, and the `hydra`
        # key is left out. Converting the whole root instead needs a copy without `hydra` merged into
        # a fresh schema first, 30x the cost, and a command types its configuration four times.
        return Config(**{f.name: _section(cfg, f.name) for f in fields(Config)})
    if "hydra" in cfg:  # the copy without it is a plain DictConfig: typed again by the schema
        cfg = OmegaConf.merge(OmegaConf.structured(Config),
                              OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))
    return OmegaConf.to_object(cfg)


def _section(cfg: Any, key: str) -> Any:
    """One key of a typed composition as `OmegaConf.to_object` gives it: a section as its
    dataclass, a value resolved (an enum field as its Enum)."""
    from omegaconf import OmegaConf

    value = cfg[key]
    return OmegaConf.to_object(value) if OmegaConf.is_config(value) else value


def saved_form(cfg: Config) -> Any:
    """A typed configuration as the DictConfig Hydra would have composed (what .hydra/config.yaml
    holds, what wandb records), without its `hydra` section."""
    from omegaconf import OmegaConf

    return OmegaConf.structured(cfg)


def switch_component(section: Any, point: str, name: str) -> Any:
    """The settings of component `name` of `point` with its own defaults, keeping the settings every
    component of the point shares (the base's: an optimizer's lr, an estimator's eps) from `section`."""
    base = SETTINGS_BASES[point]
    cls = registry(point).get(name)
    shared = {f.name: getattr(section, f.name) for f in fields(base) if f.name != "name"}
    return component_settings(point, name, cls, base).__class__(name=name, **shared)


def saved_config(data: dict[str, Any]) -> Any:
    """A saved configuration (plain data: a run's .hydra/config.yaml), in today's layout
    (distzo.config.legacy) and typed by the schema, each group section by its component's settings."""
    from omegaconf import OmegaConf

    register_configs()
    data = upgrade_saved(data)
    sections = {}
    for point, base in SETTINGS_BASES.items():
        group = registry(point).point.group
        section = data.pop(group, None)
        if isinstance(section, dict) and section.get("name") is not None:
            cls = registry(point).get(section["name"], key=f"{group}.name")
            sections[group] = OmegaConf.merge(OmegaConf.structured(component_settings(point, cls.name, cls, base)),
                                              section)
    cfg = OmegaConf.merge(OmegaConf.structured(Config), data)
    for group, node in sections.items():
        cfg[group] = node
    return cfg


def config_dir() -> str:
    """The packaged presets: config.yaml and its groups, in conf/ at the top of the source tree,
    which the package reaches as distzo/config/presets (a link in the tree, real files in a wheel)."""
    presets = Path(__file__).resolve().parent / "presets"
    if not (presets / "config.yaml").is_file():
        raise ConfigError(f"the packaged presets are missing ({presets}/config.yaml); reinstall distzo")
    return str(presets)


def user_config_dirs(extra: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """Your own config directories: `extra`, then those of $DISTZO_CONFIG_PATH (colon-separated).
    Each holds preset groups laid out as the packaged ones (`task/mytask.yaml`, `model/mine.yaml`)."""
    dirs = [Path(os.path.expanduser(str(d))) for d in extra]
    dirs += [Path(os.path.expanduser(d)) for d in os.environ.get(CONFIG_PATH_ENV, "").split(":") if d]
    for d in dirs:
        if not d.is_dir():
            raise ConfigError(f"config directory {d} does not exist; create it with your presets in group folders "
                              f"(e.g. {d}/task/mytask.yaml), or fix {CONFIG_PATH_ENV}")
        check_no_shadowed_presets(d)
    return [d.resolve() for d in dirs]


def check_no_shadowed_presets(directory: Path) -> None:
    """Refuse a preset of your config directory that has the path of a packaged one: Hydra searches
    the packaged presets (its primary config directory) before `hydra.searchpath`, so such a file
    would never be read, silently. (The packaged directory itself, or links to its files, pass.)"""
    presets = Path(config_dir()).resolve()
    for packaged in sorted(presets.glob("*/**/*.yaml")):  # group folders' presets, not config.yaml
        rel = packaged.relative_to(presets)
        mine = directory / rel
        if mine.is_file() and not mine.samefile(packaged):
            group, name = rel.parent.as_posix(), rel.stem
            raise ConfigError(f"{mine} would never be read: distzo's packaged preset {group}={name} has its name, "
                              f"and Hydra searches the packaged presets first; rename yours (e.g. "
                              f"{group}/{name}-ours.yaml) and select it with {group}={name}-ours")


def search_path_override(dirs: Sequence[Path]) -> list[str]:
    """The `hydra.searchpath` override that adds `dirs` to Hydra's config search path ([] for none)."""
    if not dirs:
        return []
    return ["hydra.searchpath=[" + ",".join(f"'file://{d}'" for d in dirs) + "]"]


def compose_config(overrides: Sequence[str] = (), with_hydra: bool = False,
                   config_dirs: Sequence[str | os.PathLike] = ()) -> Any:
    """The composed run configuration for command-line style overrides (Hydra's compose API), one
    ConfigError for any mistake. with_hydra=True also applies (and so checks) `hydra.*` overrides
    and keeps the `hydra` node. config_dirs: your own config directories (and $DISTZO_CONFIG_PATH)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    overrides = upgrade_overrides(list(overrides))
    check_override_grammar(overrides)
    if not with_hydra:  # the search path stays: it decides which presets exist
        overrides = [o for o in overrides
                     if not o.lstrip("+~").startswith("hydra") or override_key(o) == "hydra.searchpath"]
    if not any(override_key(o) == "hydra.searchpath" for o in overrides):
        overrides = search_path_override(user_config_dirs(config_dirs)) + overrides
    key = (tuple(overrides), with_hydra, os.getcwd())  # the hydra section records the working directory
    if _composed is not None and key in _composed:
        return copy.deepcopy(_composed[key])
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="distzo"):
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=with_hydra)
    except ConfigError:
        raise
    except Exception as exc:  # Hydra and OmegaConf raise many types; all are input errors here
        raise ConfigError(explain(exc)) from None
    check_added_keys(cfg, overrides)
    if _composed is not None:
        _composed[key] = copy.deepcopy(cfg)
    return cfg


_composed: dict[tuple, Any] | None = None  # what compose_config composed within `composed_once()`


@contextmanager
def composed_once() -> Iterator[None]:
    """Within: `compose_config` composes each set of overrides once and hands out copies. One command
    composes its configuration more than once (the command line checks it before deciding whether
    to start workers, Hydra's application checks it again before creating the run directory), at
    0.2-0.6 s a composition. The presets and config directories do not change meanwhile."""
    global _composed
    outer, _composed = _composed, ({} if _composed is None else _composed)
    try:
        yield
    finally:
        _composed = outer


def check_added_keys(cfg: Any, overrides: Sequence[str]) -> None:
    """`+key=value` adds a key even where the schema has no such field, and the typed configuration
    would then drop it (a typo such as +optim.lrr=1 or +optm.lr=1 trained with the default) or fail on
    it: refused, as an unknown key without + is. Keys may be added inside the open sections
    (model.arch_config); a config group appended (+experiment=x, merged where its package says)
    creates no key of its name."""
    from omegaconf import OmegaConf

    absent = object()
    for override in overrides:
        key = override_key(override)
        if not override.startswith("+") or key.startswith("hydra") or "/" in key or "@" in key:
            continue
        if OmegaConf.select(cfg, key, default=absent) is absent:
            continue
        node, parts = cfg, key.split(".")
        for part in parts:
            schema = OmegaConf.get_type(node) if OmegaConf.is_config(node) else None
            if schema is None or not is_dataclass(schema):
                break  # an open section: any key
            if part not in {f.name for f in fields(schema)}:
                raise ConfigError(unknown_key(key, added=True))
            node = node[part]


def unknown_key(name: str, added: bool = False) -> str:
    """The refusal of a key the configuration does not have: the component whose setting it is, or
    where the valid keys are listed (added: it was set with +)."""
    owners = setting_owners(name)
    if owners:
        group = name.split(".")[0]
        named = [f"{group}={o}" for o in owners]
        which = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"
        return f"{name} is a setting of {which}, not of the chosen {group}; add {named[0]}"
    where = " (+ adds keys only inside the open sections, such as model.arch_config)" if added else ""
    return f"unknown config key '{name}'; see `python -m distzo train --cfg job` for the valid keys{where}"


def override_key(override: str) -> str:
    """The key a command-line override sets (`+a.b=1` -> `a.b`, `hydra/launcher=x` -> `hydra/launcher`)."""
    return override.split("=", 1)[0].lstrip("+~")


# Settings that name a local file or folder (or a hub id, which no local path shadows).
PATH_SETTINGS = ("model.path", "model.tokenizer", "task.path", "eval.run")


def absolute_path_overrides(overrides: list[str], cwd: str | None = None) -> list[str]:
    """The overrides with a relative `PATH_SETTINGS` value that exists here made absolute, as Hydra's
    `to_absolute_path` would: it then names the same file under `hydra.job.chdir=true` (the job runs in
    its output directory), in the saved configuration an `eval.run=...` reads from another directory,
    and in a resumed run started elsewhere. A value that exists nowhere here (a hub id), a sweep's
    list, or an interpolation is left as written."""
    cwd = cwd or os.getcwd()
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        bare = value.strip("'\"")
        named = override_key(o) == "model.tokenizer" and bare == "smollm2"  # the preset's name comes first
        if (override_key(o) in PATH_SETTINGS and bare and not named and not os.path.isabs(os.path.expanduser(bare))
                and not any(c in bare for c in ",()[]{}$") and os.path.exists(os.path.join(cwd, bare))):
            path = os.path.normpath(os.path.join(cwd, bare))
            o = f"{key}={path}" if re.fullmatch(r"[\w./+@~-]+", path) else f"{key}={hydra_quoted(path)}"
        out.append(o)
    return out


def hydra_quoted(value: str) -> str:
    """`value` as one single-quoted string of Hydra's override grammar."""
    # In Hydra's quoted strings a backslash escapes only a quote, or the backslashes before one
    # (the closing quote included); elsewhere it is itself.
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\" if m.group(2) else "") + m.group(2),
                        value) + "'"


def shell_quoted_override(key: str, value: str) -> str:
    """`key=value` with the value as one quoted string of Hydra's grammar, itself double-quoted for
    the shell: the form to type when the bare value holds override syntax."""
    text = f"{key}={hydra_quoted(value)}"
    for ch in ("\\", '"', "$", "`"):  # what a double-quoted shell word still interprets
        text = text.replace(ch, "\\" + ch)
    return f'"{text}"'


def check_override_grammar(overrides: list[str]) -> None:
    """Each override alone through Hydra's parser, so a value that its grammar rejects (a template
    with braces, a text with a colon or a comma) is named with the quoted form that works, instead of
    the parser's "no viable alternative at input"."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException:
            key, sep, value = override.partition("=")
            if not sep:
                raise ConfigError(f"'{override}' is not an override; write key=value (e.g. steps=100)") from None
            raise ConfigError(f"{key}: Hydra's override grammar cannot read the value {value!r} "
                              "(braces, brackets, quotes, commas, colons and some spaces are its syntax); "
                              f"quote the value: {shell_quoted_override(key, value)}") from None


def setting_owners(key: str) -> list[str]:
    """The registered components whose own setting `key` is (`estimator.rank` -> [agzo])."""
    group, _, field = key.partition(".")
    point = {registry(p).point.group: p for p in SETTINGS_BASES}.get(group)
    if point is None or "." in field:
        return []
    return [name for name, cls in registry(point).items()
            if field in {f.name for f in fields(getattr(cls, "Settings", SETTINGS_BASES[point]))}]


def explain(exc: BaseException) -> str:
    """One line from Hydra's and OmegaConf's multi-line composition errors."""
    text = str(exc)
    if exc.__cause__ is not None:  # "Error merging override x=y" carries the reason in its cause
        text = f"{text}\n{exc.__cause__}"
    ambiguous = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if ambiguous:
        key, value = ambiguous.groups()
        return (f"{key}={value}: a comma separates the values of a sweep (with -m) or of a list ([a,b]); for one "
                f"text holding a comma, quote it: {shell_quoted_override(key, value)}")
    missing = re.search(r"Could not find '([^']+)/([^'/]*)'", text)
    if missing:
        group, option = missing.groups()
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        hint = f"; available: {', '.join(options)}" if options else ""
        plugin = PLUGINS.get((group, option))
        if plugin:
            hint += f" (it comes with a Hydra plugin: pip install {plugin})"
        return f"unknown {group} preset '{option}'{hint}"
    not_in_struct = re.search(r"Key '([^']+)' is not in struct", text) or re.search(
        r"Could not override '([^']+)'", text)
    if not_in_struct:
        key = not_in_struct.group(1)
        full = re.search(r"full_key: (\S+)", text)
        return unknown_key(full.group(1) if full else key)
    conversion = re.search(r"Value '([^']*)' (?:of type '\w+' )?could not be converted to (\w+)", text)
    if conversion:
        value, kind = conversion.groups()
        full = re.search(r"full_key: (\S+)", text)
        where = f"{full.group(1)}=" if full else ""
        return f"{where}{value!s}: expected {kind.lower()}"
    boolean = re.search(r"Value '([^']*)' is not a valid bool", text)
    if boolean:
        override = re.search(r"Error merging override (\S+?)=", text)
        return f"{override.group(1) + '=' if override else ''}{boolean.group(1)}: expected true or false"
    choice = re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", text)
    if choice:  # a choice field's Enum
        value, options = choice.groups()
        full = re.search(r"full_key: (\S+)", text)
        return f"{full.group(1) if full else 'value'}={value!r} is not supported; use one of: {options}"
    invalid = re.search(r"Invalid value assigned: (.*)", text)
    if invalid:
        full = re.search(r"full_key: (\S+)", text)
        return f"{full.group(1) if full else 'value'}: {invalid.group(1).rstrip('.')}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(lines[:2]) if lines else type(exc).__name__


def concrete_override_sets(overrides: list[str]) -> list[list[str]]:
    """Sweep overrides (`lr=1e-5,2e-5`, `range(...)`, `choice(...)`) expanded so that every value is
    checked once: the first set takes each sweep's first value; each further set changes one sweep."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep

    parsed = OverridesParser.create().parse_overrides(overrides)
    base = []
    sweeps: list[tuple[int, list[str]]] = []
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            sweep = o.value()
            if isinstance(sweep, IntervalSweep):  # a sweeper's range (Optuna's interval): its two ends
                points = [sweep.start, sweep.end]
                if isinstance(sweep.start, int) and isinstance(sweep.end, int):
                    points = [int(x) for x in points]
                values = [f"{o.get_key_element()}={v}" for v in points]
            else:
                values = [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            base.append(values[0])
            sweeps.append((i, values[1:]))
        else:
            base.append(o.input_line)
    sets = [base]
    for i, rest in sweeps:
        for v in rest:
            sets.append(base[:i] + [v] + base[i + 1:])
    return sets
