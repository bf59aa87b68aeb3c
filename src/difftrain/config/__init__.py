"""Typed config dataclasses, TOML loading, ``--set`` overrides and validation."""

from difftrain.config.load import describe, from_dict, load_config, to_dict, to_toml
from difftrain.config.schema import Config

__all__ = ["Config", "load_config", "from_dict", "to_dict", "to_toml", "describe"]
