"""Load a TOML config, apply ``--set section.key=value`` overrides, validate, and print it back.

Validation happens here, before any work starts: unknown sections or keys, values of the wrong
type and values outside their declared range all raise ``UserError`` naming the file, the key,
the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from difftrain.config.schema import Config, edit_kind_weights
from difftrain.errors import UserError


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        (arg,) = typing.get_args(tp)
        return f"list of {_type_name(arg)}"
    if tp is dict:
        return "a table"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin is list:
        (arg,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where} = {value!r}: expected {_type_name(tp)}")
        return [_coerce(v, arg, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where} = {value!r}: expected a table {{key = value, ...}}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where} = {value!r}: expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where} = {value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where} = {value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise UserError(f"{where} = {value!r}: expected a string")
        return value
    raise TypeError(f"unsupported config type {tp} at {where}")  # a bug in schema.py, not user input


def _check_range(value: Any, md: dict, where: str) -> None:
    if md.get("choices") is not None and value not in md["choices"]:
        choices = ", ".join(repr(c) for c in md["choices"])
        raise UserError(f"{where} = {value!r}: expected one of {choices}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for key, ok, text in (("ge", lambda a, b: a >= b, ">="), ("gt", lambda a, b: a > b, ">"),
                              ("le", lambda a, b: a <= b, "<="), ("lt", lambda a, b: a < b, "<")):
            bound = md.get(key)
            if bound is not None and not ok(value, bound):
                raise UserError(f"{where} = {value!r}: expected a value {text} {bound}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(__import__(cls.__module__, fromlist=["_"])))


_RENAMED = {
    "train.batch_size": " (replaced by train.global_batch, the samples of one optimizer step over all ranks, "
                        "and train.micro_batch)",
    "data.world": " (replaced by data.source = 'shapes' | 'store')",
    "train.grad_accum": " (gradient accumulation is now derived: global_batch / (data-parallel size x micro_batch))",
}


def from_dict(data: dict[str, Any], source: str = "config", check: bool = True) -> Config:
    """Build a validated ``Config`` from a nested dict (the parsed TOML); ``check = False``: each key's type and range
    only, the checks across keys left to the caller (``validate``)."""
    cfg = Config()
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for sec_name, sec_value in data.items():
        if sec_name not in sections:
            raise UserError(f"{source}: unknown section [{sec_name}]; expected one of {', '.join(sections)}")
        if not isinstance(sec_value, dict):
            raise UserError(f"{source}: [{sec_name}] must be a table of keys, got {sec_value!r}")
        section = getattr(cfg, sec_name)
        fields = {f.name: f for f in dataclasses.fields(section)}
        hints = _hints(type(section))
        for key, value in sec_value.items():
            where = f"{source}: {sec_name}.{key}"
            if key not in fields:
                hint = _RENAMED.get(f"{sec_name}.{key}", "")
                raise UserError(f"{where}: unknown key{hint}; [{sec_name}] has {', '.join(fields)}")
            value = _coerce(value, hints[key], where)
            _check_range(value, fields[key].metadata, where)
            setattr(section, key, value)
    if check:
        validate(cfg, source)
    return cfg


def validate(cfg: Config, source: str = "config") -> None:
    """Checks that involve more than one key."""
    m = cfg.model
    if m.hidden % m.heads:
        raise UserError(f"{source}: model.hidden = {m.hidden} must be divisible by model.heads = {m.heads}")
    head_dim = m.hidden // m.heads
    if sum(m.axes_dims_rope) != head_dim or any(d % 2 for d in m.axes_dims_rope) or len(m.axes_dims_rope) != 3:
        raise UserError(f"{source}: model.axes_dims_rope = {m.axes_dims_rope}: expected 3 even numbers "
                        f"summing to the head dim {head_dim} (hidden / heads)")
    if m.double_blocks + m.single_blocks == 0:
        raise UserError(f"{source}: model.double_blocks + model.single_blocks must be >= 1")
    par = cfg.parallel
    for key in ("dp_replicate", "dp_shard", "cp"):
        if getattr(par, key) == 0:
            raise UserError(f"{source}: parallel.{key} = 0: expected a size >= 1, or -1 for the rest of the world")
    if not re.fullmatch(r"none|full|selective|every:[1-9][0-9]*", par.ac):
        raise UserError(f"{source}: parallel.ac = {par.ac!r}: expected 'none', 'full', 'selective' or 'every:N' "
                        "with N >= 1")
    if par.cp > 1 and m.heads % par.cp:
        raise UserError(f"{source}: parallel.cp = {par.cp} must divide model.heads = {m.heads} (Ulysses splits "
                        f"heads): use one of {[c for c in range(1, m.heads + 1) if m.heads % c == 0]}")
    tc = cfg.train
    if tc.micro_batch and tc.global_batch % tc.micro_batch:
        raise UserError(f"{source}: train.micro_batch = {tc.micro_batch} must divide train.global_batch = "
                        f"{tc.global_batch}")
    d = cfg.data
    if len(d.background) != 2 or not 0 <= d.background[0] <= d.background[1] <= 255:
        raise UserError(f"{source}: data.background = {d.background}: expected [lo, hi] with 0 <= lo <= hi <= 255")
    if d.t2i_weight + d.edit_weight + d.keyframe_weight <= 0:
        raise UserError(f"{source}: data.t2i_weight + data.edit_weight + data.keyframe_weight must be > 0")
    if d.edit_kinds:
        for k, v in d.edit_kinds.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise UserError(f"{source}: data.edit_kinds.{k} = {v!r}: expected a number >= 0")
        try:
            edit_kind_weights(d.edit_kinds)
        except ValueError as e:
            raise UserError(f"{source}: data.{e}") from None
    ae = cfg.autoencoder
    if ae.kind == "pixel-unshuffle" and d.image_size % (ae.factor * 2):
        raise UserError(f"{source}: data.image_size = {d.image_size} must be a multiple of "
                        f"2 x autoencoder.factor = {2 * ae.factor} (2x2 patches of the latent)")
    if ae.kind == "diffusers" and not ae.path:
        raise UserError(f"{source}: autoencoder.kind = 'diffusers' needs autoencoder.path")
    if cfg.text.kind == "hf" and not (cfg.text.t5_path or cfg.text.clip_path):
        raise UserError(f"{source}: text.kind = 'hf' needs text.t5_path and/or text.clip_path")
    if d.source == "store" and not d.store:
        raise UserError(f"{source}: data.source = 'store' needs data.store (the path 'difftrain prepare' wrote)")
    if d.stages:
        from difftrain.config.stages import parse_stages
        parse_stages(cfg, source)        # raises UserError naming the stage and key
    _check_previews(cfg, source)
    from difftrain.config.refusals import check_buildable
    check_buildable(cfg, source)         # combinations a run would refuse while building its model


def _check_previews(cfg: Config, source: str) -> None:
    """preview.prompts: tables of known keys, each of its type and in range; sizes the autoencoder can take."""
    from difftrain.config.schema import PREVIEW_KEYS

    step = 16 if cfg.autoencoder.kind == "diffusers" else 2 * cfg.autoencoder.factor
    for key in ("width", "height"):
        v = getattr(cfg.preview, key)
        if v and v % step:
            raise UserError(f"{source}: preview.{key} = {v}: expected a multiple of {step} (2x2 patches of the latent)")
    for i, item in enumerate(cfg.preview.prompts):
        where = f"{source}: preview.prompts[{i}]"
        if not isinstance(item, dict):
            raise UserError(f"{where} = {item!r}: expected a table {{prompt = '...', width = W, ...}}")
        unknown = sorted(set(item) - set(PREVIEW_KEYS))
        if unknown:
            raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; expected {', '.join(PREVIEW_KEYS)}")
        if not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise UserError(f"{where}: needs prompt = '...' (a non-empty string)")
        for key, tp in PREVIEW_KEYS.items():
            if key == "prompt" or key not in item:
                continue
            v = _coerce(item[key], tp, f"{where}.{key}")
            bounds = {"width": (step, 4096), "height": (step, 4096), "seed": (0, 2 ** 63 - 1),
                      "guidance": (0.0, 100.0)}[key]
            if not bounds[0] <= v <= bounds[1] or (key in ("width", "height") and v % step):
                raise UserError(f"{where}.{key} = {v!r}: expected {bounds[0]}..{bounds[1]}"
                                + (f", a multiple of {step}" if key in ("width", "height") else ""))
            item[key] = v


def parse_override(item: str) -> tuple[list[str], Any]:
    """``section.key=value`` -> (["section", "key"], value). The value is read as TOML when it parses
    (numbers, true/false, [lists], "quoted"), otherwise taken as a bare string."""
    if "=" not in item:
        raise UserError(f"--set {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise UserError(f"--set {item!r}: expected section.key=value (one dot), e.g. train.lr=1e-4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


MAX_STEPS_ENV = "DIFFTRAIN_MAX_STEPS"   # a cap on train.steps and sample.steps, applied after --set
MAX_EXTENDS = 8      # a chain of ``extends`` longer than this is a mistake, not a design


def _merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``: tables merge key by key; any other value (arrays of tables included, such as
    ``[[data.sources]]``) replaces the base's."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read(p: Path, chain: tuple[Path, ...] = (), user: set[str] | None = None) -> dict[str, Any]:
    """A config file's tables, on top of what its top-level ``extends`` names (a preset, or a .toml path relative
    to the file), recursively. ``user`` collects the ``section.key`` names set by files that are not shipped presets
    (what the user said, as against what a preset says: ``config.base``)."""
    if not p.is_file():
        raise UserError(f"{p}: config file not found" + (f" (extended by {chain[-1]})" if chain else ""))
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML ({e})") from None
    except UnicodeDecodeError:
        raise UserError(f"{p}: not a UTF-8 text file (expected a TOML config)") from None
    if user is not None and not _is_preset(p):
        user.update(f"{sec}.{key}" for sec, table in data.items() if isinstance(table, dict) for key in table)
    if "extends" not in data:
        return data
    base = data.pop("extends")
    if not isinstance(base, str) or not base.strip():
        raise UserError(f"{p}: extends = {base!r}: expected a preset name (difftrain config presets) or a path to a "
                        ".toml file")
    local = (p.parent / base) if not Path(base).is_absolute() else Path(base)
    if local.is_file():
        bp = local
    else:
        from difftrain.config import preset_path
        try:
            bp = preset_path(base)
        except UserError as e:
            raise UserError(f"{p}: extends = {base!r}: {e}") from None
    here = chain + (p.resolve(),)
    if bp.resolve() in here:
        raise UserError(f"{p}: extends = {base!r} makes a cycle: " + " -> ".join(map(str, here + (bp.resolve(),))))
    if len(here) > MAX_EXTENDS:
        raise UserError(f"{p}: extends chains more than {MAX_EXTENDS} files deep")
    return _merge(_read(bp, here, user), data)


def _is_preset(p: Path) -> bool:
    from difftrain.config import PRESETS
    return p.resolve().parent == PRESETS.resolve()


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (TOML; None = defaults; a top-level ``extends = "PRESET or path"`` starts from that config,
    the file's own keys on top), apply overrides, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    user: set[str] = set()
    if path is not None:
        p = Path(path)
        source = str(p)
        data = _read(p, user=user)
    for item in overrides:
        (sec, key), value = parse_override(item)
        user.add(f"{sec}.{key}")
        data.setdefault(sec, {})
        if not isinstance(data[sec], dict):
            raise UserError(f"--set {item!r}: [{sec}] is not a table in {source}")
        data[sec][key] = value
    where = source + (" (with --set)" if overrides else "")
    cfg = from_dict(data, where, check=False)
    from difftrain.config.base import resolve_base
    resolve_base(cfg, user, where)       # what model.init_from's folder says of the model, encoders and VAE
    validate(cfg, where)
    cap = os.environ.get(MAX_STEPS_ENV, "").strip()
    if cap:                       # the docs' tests run every command as written, only shorter (docs/configuration.md)
        if not cap.isdigit():
            raise UserError(f"{MAX_STEPS_ENV}={cap!r}: expected a whole number of steps")
        cfg.train.steps = min(cfg.train.steps, int(cap))
        cfg.sample.steps = min(cfg.sample.steps, int(cap))
    return cfg


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_value(k)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML that ``load_config`` reads back to an equal ``Config``."""
    out = []
    for sec, values in to_dict(cfg).items():
        out.append(f"[{sec}]")
        out.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
        out.append("")
    return "\n".join(out)


def describe(cfg_cls: type = Config) -> list[tuple[str, str, str]]:
    """(key, default, doc) for every key: used by ``config show --keys`` and the README."""
    rows = []
    for sec in dataclasses.fields(cfg_cls):
        inst = sec.default_factory()  # type: ignore[misc]
        for f in dataclasses.fields(inst):
            rows.append((f"{sec.name}.{f.name}", _toml_value(getattr(inst, f.name)), f.metadata.get("doc", "")))
    return rows


__all__ = ["load_config", "from_dict", "to_toml", "to_dict", "parse_override", "describe", "validate"]
