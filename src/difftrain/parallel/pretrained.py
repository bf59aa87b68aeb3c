"""Start training from pretrained weights, read shard by shard straight into a (possibly FSDP2-sharded) DiT.

``load_pretrained(dit, path)`` takes either

- a diffusers FLUX transformer: a folder with ``config.json`` and ``diffusion_pytorch_model.safetensors``, or the
  sharded ``diffusion_pytorch_model-0000k-of-0000n.safetensors`` with their ``.index.json`` (a pipeline folder with
  a ``transformer/`` inside is accepted too); or
- our own export: ``RUN/export/model.safetensors`` (keys ``dit.<param>``, maybe ``text.<param>``, which are
  ignored here), the folder holding it, or the run folder above it.

Nothing is read before everything is checked from the safetensors headers alone: the diffusers config must
describe this model, every tensor the model needs must be present with the expected shape, and nothing
unexpected may be there. A mismatch is a ``UserError`` naming the path, the first mismatching tensor (ours and
theirs), both shapes, and the missing / unexpected tensors.

Then each rank reads only the rows it holds. FSDP2 shards parameters on dim 0 (HSDP: replicated across the
first mesh dimension, sharded on dim 0 along the second), so a rank's part of every parameter is a contiguous
row range [off, off + n) with all other dimensions whole. Each of our tensors is described as a concatenation,
along dim 0, of *segments*: row ranges of source tensors. A rename is one segment (the whole tensor); a fused
q/k/v(/mlp) projection is one segment per diffusers piece, in order; the final adaLN, whose two halves diffusers
stores swapped, is two segments (the source's second half, then its first half) -- so its row range is mapped
like any other, never read whole. A rank intersects its rows with the segments and reads exactly the overlaps,
with plain reads at the rows' offsets (``parallel.reader.SafetensorsFile``: not a memory map, whose touched pages
would stay in the process's resident memory), one file at a time, every file opened once. Headers are read with ``safe_open``. No
pickle anywhere.

Every DiT parameter is overwritten (the model's own initialisation, before or after which this may be called,
does not matter for the result) and each is checked to have been written exactly once.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from difftrain.errors import UserError
from difftrain.parallel.reader import SafetensorsFile
from difftrain.models.dit import DiTParams, MMDiT
from difftrain.models.flux_adapter import FINAL_ADALN, context_output_tensors, tensor_plan, params_from_diffusers_config, \
    to_diffusers

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
DIFFUSERS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_FORMAT = "difftrain-weights/1"
EXPORT_PREFIX = "dit."

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
# DiTParams field -> the diffusers config key it comes from (for messages).
_CONFIG_KEYS = {"in_channels": "in_channels", "text_dim": "joint_attention_dim",
                "pooled_dim": "pooled_projection_dim", "hidden": "num_attention_heads x attention_head_dim",
                "heads": "num_attention_heads", "double_blocks": "num_layers", "single_blocks": "num_single_layers",
                "axes_dims_rope": "axes_dims_rope", "guidance_embed": "guidance_embeds"}


@dataclass(frozen=True)
class _Segment:
    """Rows [start, stop) of source tensor ``name``, placed at rows [dst, dst + stop - start) of ours."""
    name: str
    start: int
    stop: int
    dst: int


@dataclass
class _Source:
    kind: str                    # "diffusers" | "difftrain"
    root: Path                   # what the messages name
    files: list[Path]            # every safetensors file to open
    config: dict[str, Any] | None = None
    config_path: Path | None = None


# --- where the weights are ------------------------------------------------------------------------------
def _resolve(path: Path) -> _Source:
    if not path.exists():
        raise UserError(f"init_from {path}: no such file or directory")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise UserError(f"init_from {path}: expected a .safetensors file or a folder (a diffusers FLUX "
                            f"transformer, or a difftrain export); pickled checkpoints are not loaded")
        if path.name.startswith("diffusion_pytorch_model"):
            return _diffusers(path.parent, [path])
        return _Source("difftrain", path, [path])
    for folder in (path, path / "transformer"):
        if (folder / "config.json").is_file():
            if (folder / DIFFUSERS_INDEX).is_file():
                return _diffusers(folder, _index_files(folder / DIFFUSERS_INDEX))
            if (folder / DIFFUSERS_WEIGHTS).is_file():
                return _diffusers(folder, [folder / DIFFUSERS_WEIGHTS])
            found = sorted(p.name for p in folder.iterdir() if p.is_file())
            hint = (" (only pickled .bin weights, which are not loaded: convert them to safetensors)"
                    if any(n.endswith(".bin") for n in found) else "")
            raise UserError(f"init_from {folder}: config.json but no {DIFFUSERS_WEIGHTS} nor {DIFFUSERS_INDEX}"
                            f"{hint}; found {found[:8]}")
    for weights in (path / EXPORT_WEIGHTS, path / "export" / EXPORT_WEIGHTS):
        if weights.is_file():
            return _Source("difftrain", weights, [weights])
    found = sorted(p.name for p in path.iterdir())
    raise UserError(f"init_from {path}: not a pretrained model folder: expected a diffusers FLUX transformer "
                    f"(config.json + {DIFFUSERS_WEIGHTS} or {DIFFUSERS_INDEX}, or a pipeline folder with "
                    f"transformer/) or a difftrain export ({EXPORT_WEIGHTS}, or export/{EXPORT_WEIGHTS} in a run "
                    f"folder); found {found[:8]}{'...' if len(found) > 8 else ''}")


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"init_from {index}: not a safetensors index (a JSON object with a weight_map): {e}") from e
    files = [index.parent / f for f in sorted(set(weight_map.values()))]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise UserError(f"init_from {index.parent}: the index names shard files that are not there: {absent}")
    return files


def _diffusers(folder: Path, files: list[Path]) -> _Source:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UserError(f"init_from {folder}: diffusers weights without the config.json beside them")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"init_from {config_path}: not valid JSON: {e}") from e
    cls = config.get("_class_name", "FluxTransformer2DModel")
    if cls != "FluxTransformer2DModel":
        raise UserError(f"init_from {config_path}: a {cls}, not a FluxTransformer2DModel")
    return _Source("diffusers", folder, files, config, config_path)


# --- what each of our tensors is made of ----------------------------------------------------------------
def _diffusers_segments(p: DiTParams, shapes: dict[str, tuple[int, ...]]) -> tuple[
        dict[str, list[_Segment]], dict[str, tuple[int, ...]]]:
    """Our name -> segments, and every expected diffusers tensor -> its shape. The names and the order of the
    pieces come from the adapter's plan; the piece shapes from ``to_diffusers`` run on meta tensors, so the
    split sizes are the adapter's own."""
    theirs = {k: tuple(v.shape) for k, v in to_diffusers(
        {k: torch.empty(s, device="meta") for k, s in shapes.items()}, p).items()}
    renames, fused = tensor_plan(p)
    segments: dict[str, list[_Segment]] = {}
    for o, d in renames:
        segments[o] = [_Segment(d, 0, theirs[d][0], 0)]
    for o, ds in fused:
        at, segs = 0, []
        for d in ds:
            segs.append(_Segment(d, 0, theirs[d][0], at))
            at += theirs[d][0]
        segments[o] = segs
    for suffix in ("weight", "bias"):
        o, d = f"{FINAL_ADALN[0]}.{suffix}", f"{FINAL_ADALN[1]}.{suffix}"
        n = theirs[d][0]                   # ours = cat(theirs[h:], theirs[:h]), h = ceil(n / 2) (from_diffusers' chunk)
        h = (n + 1) // 2
        segments[o] = [_Segment(d, h, n, 0), _Segment(d, 0, h, n - h)]
    return segments, theirs


def _export_segments(shapes: dict[str, tuple[int, ...]], prefix: str) -> tuple[
        dict[str, list[_Segment]], dict[str, tuple[int, ...]]]:
    return ({k: [_Segment(prefix + k, 0, s[0], 0)] for k, s in shapes.items()},
            {prefix + k: s for k, s in shapes.items()})


# --- the check (headers only) ---------------------------------------------------------------------------
def _fmt(names: list[str], n: int = 6) -> str:
    return "[" + ", ".join(names[:n]) + (f", ... {len(names) - n} more" if len(names) > n else "") + "]"


def _config_problems(src: _Source, ours: DiTParams) -> list[str]:
    """Every difference between the params the diffusers config describes and ours. Any one is an error:
    most also show as tensor mismatches, but rope axes and theta change no shape, and a config that does
    not describe its own weights is not one to trust."""
    try:
        theirs = params_from_diffusers_config(src.config or {})
    except (KeyError, ValueError, TypeError) as e:
        raise UserError(f"init_from {src.config_path}: not a FLUX transformer config this model can take: "
                        f"{type(e).__name__}: {e}") from e
    problems = []
    for f in fields(DiTParams):
        a, b = getattr(theirs, f.name), getattr(ours, f.name)
        if a != b:
            problems.append(f"{f.name} is {b} here but {a} there ({_CONFIG_KEYS.get(f.name, 'fixed by diffusers')})")
    return problems


def _check(src: _Source, segments: dict[str, list[_Segment]], expected: dict[str, tuple[int, ...]],
           ours: dict[str, tuple[int, ...]], headers: dict[str, tuple[Path, tuple[int, ...]]],
           config_problems: list[str]) -> None:
    """Raise one UserError describing everything that does not fit; return when the load can go ahead."""
    first = None
    for o in ours:                        # our parameter order, pieces in order
        for s in segments.get(o, ()):
            if s.name in headers and headers[s.name][1] != expected[s.name]:
                first = (f"first mismatching tensor: ours {o!r} (shape {ours[o]}) <- {s.name!r} in "
                         f"{headers[s.name][0].name}: expected shape {expected[s.name]}, found {headers[s.name][1]}")
                break
        if first:
            break
    missing = sorted(set(expected) - set(headers))
    prefix = _prefix_of(set(headers)) if src.kind == "difftrain" else ""
    unexpected = sorted(k for k in set(headers) - set(expected) if k.startswith(prefix))
    unmapped = sorted(set(ours) - set(segments))
    if not (first or missing or unexpected or unmapped or config_problems):
        _check_tiling(segments, ours)
        return
    parts = [f"init_from {src.root} does not fit this model"]
    if config_problems:
        parts.append(f"{src.config_path}: " + ", ".join(config_problems))
    if first:
        parts.append(first)
    if missing:
        parts.append(f"missing {len(missing)} tensors {_fmt(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)} tensors {_fmt(unexpected)}")
    if unmapped:
        parts.append(f"this model's {_fmt(unmapped)} have no counterpart in a {src.kind} checkpoint")
    raise UserError("; ".join(parts))


def _check_tiling(segments: dict[str, list[_Segment]], ours: dict[str, tuple[int, ...]]) -> None:
    """Internal consistency: the segments of each of our tensors cover its rows exactly once."""
    for o, segs in segments.items():
        at = 0
        for s in sorted(segs, key=lambda s: s.dst):
            if s.dst != at:
                raise RuntimeError(f"load_pretrained: segments of {o} do not tile its rows: {segs}")
            at += s.stop - s.start
        if at != ours[o][0]:
            raise RuntimeError(f"load_pretrained: segments of {o} cover {at} of {ours[o][0]} rows")


def _prefix_of(names: set[str]) -> str:
    return EXPORT_PREFIX if any(k.startswith(EXPORT_PREFIX) for k in names) else ""


# --- the load -------------------------------------------------------------------------------------------
def _local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(the tensor this rank writes into, its first global row, its number of rows)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if p.dim() == 0:
        raise ValueError("load_pretrained reads row ranges: 0-d parameters are not supported")
    if not isinstance(p, DTensor):
        return p.data, 0, p.shape[0]
    if any(not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0)) for pl in p.placements):
        raise ValueError(f"load_pretrained reads row ranges: placements {p.placements} are not Shard(0)/Replicate")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = p.to_local()
    if tuple(local.shape) != tuple(shape) or tuple(shape[1:]) != tuple(p.shape[1:]):
        raise ValueError(f"unexpected local shard of a {tuple(p.shape)} parameter: local {tuple(local.shape)}, "
                         f"computed {tuple(shape)} at {tuple(offset)}")
    return local, offset[0], shape[0]


def load_pretrained(dit: MMDiT, path: str | Path, on_loaded=None, materialize=None, skip=frozenset()) -> dict:
    """Overwrite every parameter of ``dit`` (plain or FSDP2/HSDP-sharded) with pretrained weights from ``path``,
    reading only the rows this rank holds, cast to each parameter's dtype. ``on_loaded(name)`` is called as soon
    as a parameter (the plain model's name) is whole, and this function keeps no reference to it afterwards: a
    frozen base is quantized layer by layer as it is read (``models.base_quant``), never whole in full precision.
    A parameter still on the meta device is allocated by ``materialize(name)`` (which returns the tensor to read
    into) just before its first rows are read, so that only the parameters being read are alive at once.
    ``skip``: parameters (plain names) this rank does not read (a quantized layer another rank of the node reads and
    sends it: ``parallel.node_share``).

    Returns {"kind": "diffusers" | "difftrain", "path", "files", "tensors" (our parameters written),
    "bytes_read" (by this rank), "bytes_total" (all the source tensors the model takes)}. Raises ``UserError``
    before reading any tensor data when the checkpoint does not fit the model."""
    from safetensors import safe_open

    from difftrain.models.lora import base_name, is_adapter

    src = _resolve(Path(path))
    # the base's parameters under the plain model's names (an adapted layer's ``x.base_layer.weight`` is ``x.weight``);
    # adapters are not in a base model
    params = {base_name(k): v for k, v in dit.named_parameters() if not is_adapter(k)}
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    config_problems = _config_problems(src, dit.params) if src.kind == "diffusers" else []

    with contextlib.ExitStack() as stack:
        handles, headers, sizes = {}, {}, {}
        for f in src.files:                         # every file opened once, kept open for the reads
            try:
                h = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
                raise UserError(f"init_from {f}: not a readable safetensors file: {e}") from e
            handles[f] = h
            if src.kind == "difftrain":
                fmt = (h.metadata() or {}).get("format")
                if fmt is not None and fmt != EXPORT_FORMAT:
                    raise UserError(f"init_from {f}: format {fmt!r}, expected {EXPORT_FORMAT!r}")
                quant = (h.metadata() or {}).get("quant")
                if quant:
                    raise UserError(f"init_from {f}: weights quantized to {quant} for inference (difftrain export "
                                    f"--quant {quant}); training starts from full-precision weights: point "
                                    "model.init_from at an export made without --quant (difftrain export CKPT OUT)")
            for k in h.keys():
                sl = h.get_slice(k)
                shape = tuple(sl.get_shape())
                headers[k] = (f, shape)
                sizes[k] = _ITEMSIZE.get(sl.get_dtype(), 4) * math.prod(shape)

        # a double-only model's last block has no text output weights: diffusers' files and our exports written
        # before it lost them hold them, and they are not read
        context = context_output_tensors(dit.params)
        if src.kind == "diffusers":
            segments, expected = _diffusers_segments(dit.params, shapes)
            ignored = {d for _, d in context}
        else:
            prefix = _prefix_of(set(headers))
            segments, expected = _export_segments(shapes, prefix)
            ignored = {prefix + o for o, _ in context}
        expected = {k: v for k, v in expected.items() if k not in ignored}
        _check(src, segments, expected, shapes, {k: v for k, v in headers.items() if k not in ignored},
               config_problems)

        # Plan: this rank's rows of each parameter, intersected with the segments it is made of.
        stack.enter_context(torch.no_grad())
        reads: dict[Path, list[tuple[str, str, int, int, torch.Tensor, int]]] = {f: [] for f in src.files}
        local_rows: dict[str, int] = {}
        for o, p in params.items():
            if o in skip:
                continue
            local, off, n = _local_rows(p)
            local_rows[o] = n
            for s in segments[o]:
                lo, hi = max(off, s.dst), min(off + n, s.dst + s.stop - s.start)
                if lo < hi:
                    a = s.start + lo - s.dst
                    reads[headers[s.name][0]].append((o, s.name, a, a + hi - lo, local, lo - off))
        p = local = None

        written = dict.fromkeys(local_rows, 0)
        params.clear()                               # from here the plan's items hold the only references
        bytes_read = 0
        live: dict[str, torch.Tensor] = {}         # parameters allocated by ``materialize``, until whole
        for f, items in reads.items():             # grouped by file
            h = stack.enter_context(SafetensorsFile(f))
            items.reverse()                        # popped from the end, in plan order
            while items:
                o, name, a, b, local, at = items.pop()
                if local.is_meta:
                    if materialize is None:
                        raise RuntimeError(f"load_pretrained: {o} is on the meta device and nothing allocates it")
                    if o not in live:
                        live[o] = materialize(o)
                    local = live[o]
                dest = local[at:at + (b - a)]
                try:                               # only these rows, read straight into the parameter where it can
                    t = h.read(name, (slice(a, b),), out=dest)
                except (KeyError, ValueError) as e:
                    raise UserError(f"init_from {f}: {e}") from None
                if t is not dest:
                    dest.copy_(t)                  # casts to the parameter's dtype (and device)
                del dest
                bytes_read += t.numel() * t.element_size()
                written[o] += b - a
                del local, t
                if written[o] == local_rows[o]:
                    live.pop(o, None)
                    if on_loaded is not None:
                        on_loaded(o)
    wrong = {o: f"{written[o]}/{local_rows[o]} rows" for o in written if written[o] != local_rows[o]}
    if wrong:
        raise RuntimeError(f"load_pretrained: parameters not written exactly once: {dict(list(wrong.items())[:6])}")
    return {"kind": src.kind, "path": str(src.root), "files": len(src.files), "tensors": len(local_rows),
            "bytes_read": bytes_read, "bytes_total": sum(sizes[k] for k in expected)}


def gather_to_main(t: torch.Tensor, is_main: bool) -> torch.Tensor | None:
    """The full tensor on the writing rank (global rank 0), None elsewhere. An FSDP2 shard (``Shard(0)``, with
    ``Replicate`` on HSDP's replica dimension) is gathered over the first replica's shard group into one buffer on
    rank 0 only (each shard padded to ``ceil(rows / n)`` rows, as FSDP2 chunks them); no other rank holds more than
    its own shard. Other layouts (a plain tensor, another placement) are all-gathered as before."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    t = t.detach()
    if not isinstance(t, DTensor):
        return t if is_main else None
    mesh, placements = t.device_mesh, t.placements
    sharded = [i for i, pl in enumerate(placements) if isinstance(pl, Shard)]
    simple = (len(sharded) == 1 and placements[sharded[0]].dim == 0
              and all(pl.is_replicate() for i, pl in enumerate(placements) if i != sharded[0])
              and (not is_main or dist.get_rank() == 0))
    if not simple:
        full = t.full_tensor()
        return full if is_main else None
    d = sharded[0]
    coord = mesh.get_coordinate()
    if any(coord[i] for i in range(mesh.ndim) if i != d):      # another replica: the first one's ranks send
        return None
    n, rows = mesh.size(d), t.shape[0]
    per = -(-rows // n)
    local = t.to_local()
    piece = local if local.shape[0] == per else torch.cat(
        [local, local.new_zeros((per - local.shape[0], *local.shape[1:]))])
    group = mesh.get_group(d)
    if coord[d] == 0:
        out = local.new_empty((n * per, *t.shape[1:]))
        dist.gather(piece.contiguous(), list(out.chunk(n)), group=group, group_dst=0)
        return out[:rows] if is_main else None
    dist.gather(piece.contiguous(), None, group=group, group_dst=0)
    return None


def export_dtype(cfg, compute: torch.dtype | None) -> torch.dtype:
    """``train.export_dtype``: 'auto' writes the dtype the run computed in (bf16 under bf16 autocast), else as
    set."""
    name = cfg.train.export_dtype
    if name == "auto":
        return torch.bfloat16 if compute == torch.bfloat16 else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def write_weights(named: dict[str, torch.Tensor], cfg, out: Path, is_main: bool, transform=None,
                  dtype: torch.dtype = torch.float32) -> Path:
    """A live model's weights as ``OUT/model.safetensors`` (floating tensors in ``dtype``) with ``OUT/config.toml``:
    the layout ``difftrain export`` writes, streamed as it streams: rank 0 writes the header, then each tensor as
    it is gathered to it (one at a time, a collective: every rank calls this; ``gather_to_main``), so rank 0 holds
    one full tensor beyond its shards and every other rank none. Written under a temporary name and renamed, so a
    crash leaves no half file. ``transform(name, full)``: the tensor written instead of the gathered ``full`` one
    (same shape); called on every rank in the same order with ``full`` None off the writing rank, so it may
    gather too (a LoRA export folds each adapter in here) and must return None where ``full`` is None."""
    from difftrain.config import to_toml
    from difftrain.parallel.stream_writer import SafetensorsStreamWriter

    def out_dtype(v: torch.Tensor) -> torch.dtype:
        return dtype if v.dtype.is_floating_point else v.dtype

    entries = [(k, tuple(v.shape), out_dtype(v)) for k, v in named.items()]   # a DTensor's shape is the full one
    tmp = out / (EXPORT_WEIGHTS + ".tmp")
    from difftrain.parallel.dist import agree

    def verdict(error: str | None) -> None:
        """Rank 0 writes alone: every rank hears at once whether it could (else they would wait in the next
        gather until the collective timeout)."""
        said = agree(error)
        if said is not None:
            raise UserError(f"export to {out} failed: {said}")

    writer, error = None, None
    if is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            writer = SafetensorsStreamWriter(tmp, entries, {"format": EXPORT_FORMAT}).__enter__()
        except OSError as e:
            error = f"{tmp}: cannot start the export ({e})"
    verdict(error)

    try:
        for k, v in named.items():
            full = gather_to_main(v, is_main)
            if transform is not None:
                full = transform(k, full)
            error = None
            if writer is not None:
                try:
                    writer.write(k, full.to(out_dtype(v)))
                except OSError as e:
                    error = f"{tmp}: writing {k} failed ({e})"
            del full
            verdict(error)
    except BaseException as e:
        if writer is not None:
            writer.__exit__(type(e), e, None)
            tmp.unlink(missing_ok=True)
        raise
    error = None
    if writer is not None:
        try:
            writer.__exit__(None, None, None)
            os.replace(tmp, out / EXPORT_WEIGHTS)
            (out / "config.toml").write_text(to_toml(cfg))
        except OSError as e:
            tmp.unlink(missing_ok=True)
            error = f"{out}: finishing the export failed ({e})"
    verdict(error)
    return out / EXPORT_WEIGHTS


__all__ = ["export_dtype", "gather_to_main", "load_pretrained", "write_weights"]
