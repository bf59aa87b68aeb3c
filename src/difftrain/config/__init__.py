"""Typed config dataclasses, TOML loading, ``--set`` overrides and validation; the shipped presets."""

from pathlib import Path

from difftrain.config.load import describe, from_dict, load_config, to_dict, to_toml
from difftrain.config.schema import Config
from difftrain.errors import UserError

PRESETS = Path(__file__).resolve().parents[1] / "configs"   # package data: found in any install


def preset_path(name: str | Path) -> Path:
    """A config path as given, or the file of a shipped preset (``shapes-tiny``, ``flux-dev``, ``dit-24b``)."""
    p = Path(name)
    if p.is_file():
        return p
    for candidate in (PRESETS / str(name), PRESETS / f"{name}.toml"):
        if candidate.is_file():
            return candidate
    names = ", ".join(sorted(q.stem for q in PRESETS.glob("*.toml")))
    raise UserError(f"{name}: config file not found (give a path to a .toml file or a preset name: {names})")


__all__ = ["Config", "load_config", "from_dict", "to_dict", "to_toml", "describe", "preset_path", "PRESETS"]
