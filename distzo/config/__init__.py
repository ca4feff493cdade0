"""Configuration: the typed schema, the packaged presets (Hydra's config tree), composition with
overrides, and the checks of values types cannot express."""

from .compose import compose_config, config_dir, register_configs
from .schema import Config

__all__ = ["Config", "compose_config", "config_dir", "register_configs"]
