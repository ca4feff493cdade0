"""Configuration: the typed schema, the packaged presets (Hydra's config tree) and the checks types
cannot express."""

from .schema import Config, compose_config, config_dir, register_configs

__all__ = ["Config", "compose_config", "config_dir", "register_configs"]
