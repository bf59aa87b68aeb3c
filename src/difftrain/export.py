"""Export a training checkpoint's weights for inference, without a process group and without the model.

``export_checkpoint(checkpoint, out)`` reads only the requested tensors (``ema.*`` or ``model.*``) of a
checkpoint written by ``Checkpointer`` -- one file of full tensors, or one shard file per rank of an FSDP
run -- consolidated to full tensors through DCP's safetensors reader (shapes and dtypes come from the file
headers; nothing is unpickled), and writes one of two layouts:

- ``difftrain``: ``OUT/model.safetensors`` (keys ``dit.*``, and ``text.*`` for a trained text encoder, as
  ``Trainer.export`` writes them through ``parallel.pretrained.write_weights``; ``model.init_from`` loads it) and ``OUT/config.toml``;
- ``diffusers``: the DiT alone as a diffusers ``FluxTransformer2DModel``:
  ``OUT/transformer/diffusion_pytorch_model.safetensors`` and ``OUT/transformer/config.json``. Refused when the
  model is not one diffusers can express (absolute position embedding, MLP ratio other than 4, no q/k/v bias,
  RoPE theta other than 10000) or when its output is not a FLUX velocity (``diffusion.prediction = 'x'``).

Tensors are read in groups of bounded size and streamed into the output file, so the peak memory is about
one group, not the model. Everything is written into ``OUT.partial-*`` first and renamed to ``OUT`` at the
end: a failed export leaves no ``OUT`` behind.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from difftrain.config import Config, from_dict, to_toml
from difftrain.errors import UserError
from difftrain.models import dit_params
from difftrain.models.dit import DiTParams, MMDiT
from difftrain.models.flux_adapter import FINAL_ADALN, context_output_tensors, diffusers_config, \
    params_from_diffusers_config, tensor_plan, to_diffusers
from difftrain.parallel.pretrained import DIFFUSERS_WEIGHTS, EXPORT_FORMAT, EXPORT_PREFIX, EXPORT_WEIGHTS
from difftrain.parallel.stream_writer import SafetensorsStreamWriter as _SafetensorsWriter
from difftrain.train.checkpoint import Checkpointer

WEIGHTS = {"ema": "ema", "raw": "model"}               # --weights -> checkpoint key prefix
LAYOUTS = ("difftrain", "diffusers")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GROUP_BYTES = 1 << 30                                  # tensors read per DCP load (bounds the memory)


def weights_of(weights: str, info: dict[str, Any]) -> str:
    """``--weights auto``: the EMA where the run kept one (train.ema_decay > 0), else the raw weights."""
    if weights != "auto":
        return weights
    decay = ((info.get("config") or {}).get("train") or {}).get("ema_decay", 0)
    return "ema" if isinstance(decay, (int, float)) and decay > 0 else "raw"


def export_checkpoint(checkpoint: str | Path, out: str | Path, weights: str = "auto", layout: str = "difftrain",
                      dtype: str = "auto", overwrite: bool = False, group_bytes: int = GROUP_BYTES,
                      quant: str | None = None) -> dict[str, Any]:
    """Write the ``weights`` ("ema" | "raw" | "auto": the EMA where the run kept one) of ``checkpoint`` (a checkpoint directory, a run directory or
    ``RUN/checkpoints/latest``) to the folder ``out`` in ``layout`` ("difftrain" | "diffusers"), cast to
    ``dtype`` ("fp32" | "bf16" | "auto": the dtype the run computed in, from its trainer.json, so a FLUX.1-dev
    fine-tune trained under bf16 autocast exports its 24 GB bf16 file; ``train.precision`` where an older checkpoint
    does not say, fp32 for 'auto' there). ``out`` must not exist or be empty unless ``overwrite``.

    ``quant`` ("fp8" | "mxfp8" | "nvfp4", difftrain layout only): the linears ``--quant`` quantizes for inference
    are written in that format with their scales (``models.quant.quantized_entries``), the rest in ``dtype``; the
    file's metadata says so, and ``model.init_from`` refuses it (training needs the full-precision weights).

    Returns {"out", "tensors" (written), "bytes" (of tensor data written), "step", "weights", "layout",
    "shards" (safetensors files the tensors were read from), "quant" (when asked: the format, layers)}."""
    for name, value, choices in (("weights", weights, ("auto", *WEIGHTS)), ("layout", layout, LAYOUTS),
                                 ("dtype", dtype, ("auto", *DTYPES))):
        if value not in choices:
            raise UserError(f"export --{name} {value!r}: expected one of {', '.join(choices)}")
    if quant is not None:
        from difftrain.models.quant import check_format
        check_format(quant, "export --quant")
        if layout != "difftrain":
            raise UserError(f"export --quant {quant} --layout {layout}: diffusers' FLUX loaders read full-precision "
                            "tensors; a quantized export is written in the difftrain layout (--layout difftrain)")
    info = Checkpointer.read_info(checkpoint)
    ckpt = Path(info["path"])
    weights = weights_of(weights, info)
    out = Path(out)
    _check_out(out, ckpt, overwrite)
    if not isinstance(info.get("config"), dict):
        raise UserError(f"{ckpt}/trainer.json: no 'config' table: cannot tell which model these weights are")
    if "adapter" in info:
        raise UserError(f"{ckpt}: holds an adapter ({info['adapter'].get('kind')}) and not its frozen base: "
                        "'difftrain export CKPT OUT --adapter' writes the adapter for diffusers; a merged model is the "
                        "run's own export with adapter.export = 'merge'")
    cfg = from_dict(info["config"], f"{ckpt}/trainer.json")
    step = int(info["step"])

    metadata = _read_metadata(ckpt)
    prefix = WEIGHTS[weights]
    sources = {k[len(prefix) + 1:]: md for k, md in metadata.state_dict_metadata.items()
               if k.startswith(prefix + ".")}
    if not sources:
        if weights == "ema":
            raise UserError(f"{ckpt}: no EMA weights in this checkpoint (trained with train.ema_decay = 0): "
                            "use --weights raw")
        raise UserError(f"{ckpt}: no model weights ('model.*' tensors) in this checkpoint")
    _check_complete(ckpt, prefix, sources)
    _check_totals(ckpt, info, metadata.state_dict_metadata, prefix, sources)
    params = _check_dit(ckpt, cfg, prefix, sources)
    for o, _ in context_output_tensors(params):     # a checkpoint written before the last block lost them: not exported
        sources.pop(EXPORT_PREFIX + o, None)

    if layout == "difftrain":
        plan = _difftrain_plan(sources)
        if quant:
            plan = _quantized_plan(plan, params, quant)
    else:
        plan = _diffusers_plan(ckpt, cfg, params, sources)
    read = {f"{prefix}.{k}" for k in plan.sources}
    shards = {item.relative_path for index, item in metadata.storage_data.items() if index.fqn in read}

    if dtype == "auto":
        dtype = info.get("compute_dtype") or ("bf16" if cfg.train.precision == "bf16" else "fp32")
        if dtype not in DTYPES:
            raise UserError(f"{ckpt}/trainer.json: compute_dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    target = DTYPES[dtype]
    tmp = out.parent / f"{out.name}.partial-{secrets.token_hex(4)}"
    try:
        tmp.mkdir(parents=True)
        if layout == "difftrain":
            weights_file = tmp / EXPORT_WEIGHTS
            file_meta = {"format": EXPORT_FORMAT, "step": str(step), "weights": weights}
            if quant:
                file_meta.update(quant=quant, quant_layers=str(plan.quantized))
            (tmp / "config.toml").write_text(to_toml(cfg))
        else:
            (tmp / "transformer").mkdir()
            weights_file = tmp / "transformer" / DIFFUSERS_WEIGHTS
            file_meta = {"format": "pt"}
            (tmp / "transformer" / "config.json").write_text(json.dumps(_diffusers_json(params), indent=2) + "\n")
        n_bytes = _stream(ckpt, prefix, sources, plan, target, weights_file, file_meta, group_bytes)
        _publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "tensors": len(plan.outputs), "bytes": n_bytes, "step": step, "weights": weights,
            "dtype": dtype, "layout": layout, "shards": len(shards), **({"quant": {"format": quant, "layers": plan.quantized}}
                                                        if quant else {})}


# --- the checkpoint -------------------------------------------------------------------------------------------
def _quiet(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    # DCP warns that it "assumes a single process" when no process group exists: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return fn(*args, **kwargs)


def _read_metadata(ckpt: Path):
    """DCP metadata rebuilt from the safetensors headers of every shard file (tensor data is not read)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        return HuggingFaceStorageReader(str(ckpt)).read_metadata()
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
        raise UserError(f"{ckpt}: unreadable checkpoint shard headers ({type(e).__name__}: {e})") from None


def _check_complete(ckpt: Path, prefix: str, sources: dict[str, Any]) -> None:
    """Every element of every tensor is stored exactly once: a lost shard file leaves a hole (or, for the last
    rank's rows, a smaller tensor, which ``_check_dit`` catches for the DiT)."""
    for name, md in sources.items():
        size = tuple(md.size)
        chunks = {(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks}
        stored = sum(math.prod(s) for _, s in chunks)
        rows_only = bool(size) and all(o[1:] == (0,) * (len(size) - 1) and s[1:] == size[1:] for o, s in chunks)
        ok = stored == math.prod(size)
        if ok and rows_only:                 # FSDP shards rows: they must tile [0, rows) without overlap
            at = 0
            for o, s in sorted(chunks):
                ok = ok and o[0] == at
                at += s[0]
        if not ok:
            raise UserError(f"{ckpt}: incomplete checkpoint: {prefix}.{name} {list(size)} is not covered exactly "
                            f"once by its {len(chunks)} stored pieces (a missing or foreign shard file?)")


def _check_totals(ckpt: Path, info: dict[str, Any], everything: dict[str, Any], prefix: str,
                  sources: dict[str, Any]) -> None:
    """A tensor lost whole (a replicated tensor is stored by one rank only) changes no other tensor's shape:
    the raw weights are counted against trainer.json's parameter count, and the EMA, which shadows every
    parameter of the trained module, against the raw weights."""
    raw = {k[len("model."):]: tuple(md.size) for k, md in everything.items() if k.startswith("model.")}
    total = (info.get("num_params") or {}).get("total")
    held = sum(math.prod(s) for s in raw.values())
    if isinstance(total, int) and held != total:
        raise UserError(f"{ckpt}: incomplete checkpoint: its model.* tensors hold {held} parameters, trainer.json "
                        f"counts {total} (a missing shard file?)")
    if prefix == "ema":
        odd = sorted(k for k in raw.keys() | sources.keys() if raw.get(k) != (tuple(sources[k].size) if k in sources
                                                                                   else None))
        if odd:
            raise UserError(f"{ckpt}: incomplete checkpoint: the EMA and the raw weights differ in {odd[:4]} "
                            "(a missing shard file?)")


def _shape(sources: dict[str, Any], name: str, ckpt: Path) -> tuple[int, ...]:
    if name not in sources:
        raise UserError(f"{ckpt}: the checkpoint has no {name}: not a difftrain DiT checkpoint")
    return tuple(sources[name].size)


def _check_dit(ckpt: Path, cfg: Config, prefix: str, sources: dict[str, Any]) -> DiTParams:
    """The DiT's params (widths the config leaves to the encoders are read from the tensor shapes), with every
    ``dit.*`` tensor checked against a shapes-only (meta) model of them."""
    p = EXPORT_PREFIX
    params = dit_params(cfg, _shape(sources, f"{p}img_in.weight", ckpt)[1], _shape(sources, f"{p}txt_in.weight", ckpt)[1],
                        _shape(sources, f"{p}vector_in.in_layer.weight", ckpt)[1])
    with torch.device("meta"):
        expected = {p + k: tuple(v.shape) for k, v in MMDiT(params).named_parameters()}
    legacy = {p + o for o, _ in context_output_tensors(params)}   # written before the last block lost them
    found = {k: tuple(md.size) for k, md in sources.items() if k.startswith(p) and k not in legacy}
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    wrong = [f"{k} {list(found[k])} (expected {list(s)})" for k, s in expected.items() if k in found and found[k] != s]
    if missing or unexpected or wrong:
        parts = [f"missing {missing[:4]}"] * bool(missing) + [f"unexpected {unexpected[:4]}"] * bool(unexpected)
        parts += [f"shapes {wrong[:3]}"] * bool(wrong)
        raise UserError(f"{ckpt}: the {prefix}.* tensors do not match the model of its own config "
                        f"({'; '.join(parts)}): a missing shard file?")
    return params


# --- what is written --------------------------------------------------------------------------------------
@dataclass
class _Plan:
    """``outputs``: (name, shape, our source tensor) in file order, grouped by source; ``sources``: our tensors
    read, in that order; ``convert``: {our name: full tensor} of a group of sources -> {output name: tensor}."""
    outputs: list[tuple[str, tuple[int, ...], str]]
    sources: list[str]
    convert: Callable[[dict[str, Tensor]], dict[str, Tensor]]
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)   # outputs written in their own dtype
    quantized: int = 0                                               # layers written quantized


def _difftrain_plan(sources: dict[str, Any]) -> _Plan:
    names = sorted(sources)                     # everything the prefix holds: dit.*, and text.* if trained
    return _Plan([(k, tuple(sources[k].size), k) for k in names], names, dict)


def _quantized_plan(plan: _Plan, params: DiTParams, fmt: str) -> _Plan:
    """``plan`` with the weights of the DiT's quantizable linears written quantized (values, then scales)."""
    from difftrain.models import build_dit
    from difftrain.models.quant import eligible, quantize_weight, quantized_entries

    meta = build_dit(params, device="meta")
    chosen = {f"{EXPORT_PREFIX}{n}.weight" for n, m in meta.named_modules() if eligible(m, n)}
    outputs, dtypes = [], {}
    for name, shape, src in plan.outputs:
        if name not in chosen:
            outputs.append((name, shape, src))
            continue
        for suffix, (qshape, qdtype) in quantized_entries(shape, fmt).items():
            outputs.append((name + suffix, qshape, src))
            dtypes[name + suffix] = qdtype

    def convert(group: dict[str, Tensor]) -> dict[str, Tensor]:
        done = plan.convert(group)
        for name in [n for n in done if n in chosen]:
            done.update({name + suffix: t for suffix, t in quantize_weight(done.pop(name), fmt).items()})
        return done
    return _Plan(outputs, plan.sources, convert, dtypes, len(chosen))


def _diffusers_plan(ckpt: Path, cfg: Config, params: DiTParams, sources: dict[str, Any]) -> _Plan:
    reasons = []
    try:
        diffusers_config(params)
    except ValueError as e:
        reasons.append(str(e))
    if cfg.diffusion.prediction != "v":
        reasons.append(f"diffusion.prediction = {cfg.diffusion.prediction!r}: diffusers' FLUX pipelines read the "
                       "transformer's output as the velocity eps - x0 (prediction = 'v')")
    if reasons:
        raise UserError(f"{ckpt}: cannot export to the diffusers layout: {'; '.join(reasons)} "
                        "(use --layout difftrain)")
    p = EXPORT_PREFIX
    ours = {k[len(p):]: tuple(md.size) for k, md in sources.items() if k.startswith(p)}   # text.* is left out
    renames, fused = tensor_plan(params)
    produces: dict[str, list[str]] = {o: [d] for o, d in renames}
    produces.update({o: list(ds) for o, ds in fused})
    produces.update({f"{FINAL_ADALN[0]}.{s}": [f"{FINAL_ADALN[1]}.{s}"] for s in ("weight", "bias")})
    unmapped = sorted(ours.keys() - produces.keys()) or sorted(produces.keys() - ours.keys())
    if unmapped:
        raise UserError(f"{ckpt}: cannot export to the diffusers layout: no FLUX counterpart for {unmapped[:4]}")
    meta = {k: torch.empty(s, device="meta") for k, s in ours.items()}
    shapes = {k: tuple(v.shape) for k, v in to_diffusers(meta, params).items()}

    def convert(group: dict[str, Tensor]) -> dict[str, Tensor]:
        # The adapter itself, on this group's tensors; the others stay shapes only.
        theirs = to_diffusers({**meta, **{k[len(p):]: v for k, v in group.items()}}, params)
        return {d: theirs[d] for k in group for d in produces[k[len(p):]]}

    order = sorted(ours)
    return _Plan([(d, shapes[d], p + o) for o in order for d in produces[o]], [p + o for o in order], convert)


def _diffusers_json(params: DiTParams) -> dict[str, Any]:
    config = {"_class_name": "FluxTransformer2DModel"}
    try:
        import diffusers
        config["_diffusers_version"] = diffusers.__version__
    except ImportError:
        pass
    config.update(diffusers_config(params))
    back = params_from_diffusers_config(config)             # the config must describe exactly this model
    differ = [f.name for f in fields(DiTParams) if getattr(back, f.name) != getattr(params, f.name)]
    if differ:
        raise UserError(f"cannot export to the diffusers layout: its config cannot express {differ}")
    return config


def _groups(names: list[str], sources: dict[str, Any], limit: int) -> list[list[str]]:
    """Consecutive runs of ``names`` of at most ``limit`` bytes as stored (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for k in names:
        md = sources[k]
        n = math.prod(md.size) * md.properties.dtype.itemsize
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    return [g for g in groups if g]


def _stream(ckpt: Path, prefix: str, sources: dict[str, Any], plan: _Plan, dtype: torch.dtype, path: Path,
            file_meta: dict[str, str], group_bytes: int) -> int:
    """Read the plan's sources group by group (full tensors, from every shard) and append the converted
    tensors to the safetensors file ``path``; returns the bytes of tensor data written."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    from difftrain.parallel.reader import PlainReader

    src_dtype = {k: sources[k].properties.dtype for k in plan.sources}
    out_dtype = {s: dtype if d.is_floating_point else d for s, d in src_dtype.items()}
    entries = [(n, shape, plan.dtypes.get(n, out_dtype[s])) for n, shape, s in plan.outputs]
    with _SafetensorsWriter(path, entries, file_meta) as writer:
        for group in _groups(plan.sources, sources, group_bytes):
            state = {f"{prefix}.{k}": torch.empty(tuple(sources[k].size), dtype=src_dtype[k]) for k in group}
            try:
                _quiet(load, state, storage_reader=PlainReader(str(ckpt)))
            except (Exception, CheckpointException) as e:   # CheckpointException is a BaseException
                detail = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
                raise UserError(f"{ckpt}: cannot read {prefix}.{group[0]}{' ...' if len(group) > 1 else ''} "
                                f"({detail})") from None
            converted = plan.convert({k: state[f"{prefix}.{k}"] for k in group})
            members = set(group)
            while writer.next < len(plan.outputs) and plan.outputs[writer.next][2] in members:
                name = plan.outputs[writer.next][0]
                writer.write(name, converted.pop(name).to(writer.entries[writer.next][2]))
            del state, converted
    return writer.data_bytes


# --- the output folder -----------------------------------------------------------------------------------
def _check_out(out: Path, ckpt: Path, overwrite: bool) -> None:
    here, source = out.resolve(), ckpt.resolve()
    if here == source or here in source.parents:
        raise UserError(f"export to {out}: that folder holds the checkpoint being exported; choose another")
    if out.exists() and not overwrite and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"export to {out}: exists and is not empty (choose another folder, or --overwrite)")


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished folder to ``out``; an old ``out`` (``overwrite``) is moved aside first and then
    removed, so ``out`` is always either the old or the new export."""
    old = None
    if out.exists() or out.is_symlink():
        if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
            out.rmdir()
        elif overwrite:
            old = out.parent / f"{out.name}.old-{secrets.token_hex(4)}"
            os.replace(out, old)
        else:
            raise UserError(f"export to {out}: exists and is not empty (choose another folder, or --overwrite)")
    try:
        os.replace(tmp, out)
    except OSError as e:
        if old is not None:
            os.replace(old, out)
        raise UserError(f"export to {out}: cannot move the finished export into place ({e})") from None
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


__all__ = ["export_checkpoint", "WEIGHTS", "LAYOUTS", "DTYPES"]
