"""``difftrain export CKPT OUT --adapter``: a run's adapter in diffusers' LoRA format for FLUX.

Writes ``OUT/pytorch_lora_weights.safetensors`` with keys ``transformer.<diffusers module>.lora_A.weight`` /
``lora_B.weight`` (LoRA) or ``transformer.<module>.lokr_w1`` ... (LoKr), which
``FluxTransformer2DModel.load_lora_adapter`` (and a pipeline's ``load_lora_weights``) load, plus
``OUT/adapter_config.json`` (the run's adapter and its base). The scale alpha / rank is folded into one factor (LoRA's
B, LoKr's first), so the file needs no alpha: diffusers loads it at scale 1.

Our fused layers map onto diffusers' split projections exactly: a LoRA on a fused ``qkv`` (or a single block's
``linear1``, q/k/v and the MLP input) becomes one LoRA per piece with the shared A copied and B cut by rows, since
each piece's update is B[rows] @ A. A LoKr's update kron(w1, w2) cannot be cut that way in general; a LoKr on a
double block's ``qkv`` maps onto diffusers' fused ``to_qkv`` / ``to_added_qkv`` (which diffusers builds when it
loads such a file), and a LoKr on a single block's ``linear1`` (q/k/v fused with the MLP input, which diffusers keeps
apart) is refused with what to do instead. The final layer's adaLN (ordered (shift, scale) here, (scale, shift) in
diffusers) has its B halves swapped, as the base's weights are.
"""

from __future__ import annotations

import json
import math
import secrets
import shutil
from pathlib import Path

import torch
from torch import Tensor

from difftrain.config import from_dict
from difftrain.errors import UserError
from difftrain.models.flux_adapter import _DOUBLE, _DOUBLE_FUSED, _GUIDANCE, _SINGLE, _SINGLE_FUSED, _TOP, \
    FINAL_ADALN
from difftrain.models.lora import AdapterSpec, split_name
from difftrain.train.checkpoint import Checkpointer

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
PREFIX = "transformer."


def _module_plan(double_blocks: int, single_blocks: int, hidden: int) -> dict[str, list[tuple[str, int | None]]]:
    """Our linear layer -> [(diffusers module, rows or None for all)], the pieces in row order."""
    plan: dict[str, list[tuple[str, int | None]]] = {}
    for o, d in _TOP + _GUIDANCE:
        plan[o] = [(d, None)]
    plan[FINAL_ADALN[0]] = [(FINAL_ADALN[1], None)]
    for i in range(double_blocks):
        for o, d in _DOUBLE:
            plan[f"double_blocks.{i}.{o}"] = [(f"transformer_blocks.{i}.{d}", None)]
        for o, ds in _DOUBLE_FUSED:
            plan[f"double_blocks.{i}.{o}"] = [(f"transformer_blocks.{i}.{d}", hidden) for d in ds]
    for i in range(single_blocks):
        for o, d in _SINGLE:
            plan[f"single_blocks.{i}.{o}"] = [(f"single_transformer_blocks.{i}.{d}", None)]
        for o, ds in _SINGLE_FUSED:
            plan[f"single_blocks.{i}.{o}"] = [(f"single_transformer_blocks.{i}.{d}", hidden) for d in ds[:3]] + \
                [(f"single_transformer_blocks.{i}.{ds[3]}", None)]
    return plan


def _swap_halves(t: Tensor) -> Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat((b, a), dim=0)


def to_diffusers_adapter(kind: str, factors: dict[str, dict[str, Tensor]], scale: float, double_blocks: int,
                         single_blocks: int, hidden: int) -> dict[str, Tensor]:
    """Our adapter (layer -> {factor: full tensor}) -> diffusers' keys, the scale folded in."""
    plan = _module_plan(double_blocks, single_blocks, hidden)
    out: dict[str, Tensor] = {}
    for layer, f in sorted(factors.items()):
        if layer not in plan:
            raise UserError(f"export --adapter: the adapted layer {layer!r} has no counterpart in diffusers' "
                            "FluxTransformer2DModel")
        pieces = plan[layer]
        final = layer == FINAL_ADALN[0]
        if kind == "lora":
            a, b = f["lora_A"].float(), f["lora_B"].float() * scale
            if final:
                b = _swap_halves(b)
            at = 0
            for module, rows in pieces:
                n = b.shape[0] - at if rows is None else rows
                out[f"{PREFIX}{module}.lora_A.weight"] = a.clone()          # a copy each: the file holds each once
                out[f"{PREFIX}{module}.lora_B.weight"] = b[at:at + n].contiguous()
                at += n
            continue
        if final:
            raise UserError(f"export --adapter: a LoKr on {layer!r} (its halves are swapped in diffusers' layout) "
                            "cannot be expressed as a LoKr there; leave it out of adapter.targets")
        if len(pieces) == 4:
            raise UserError(f"export --adapter: a LoKr on {layer!r} (a single block's q/k/v fused with its MLP input, "
                            "which diffusers keeps apart) has no exact LoKr there; train LoKr without 'linear1' in "
                            "adapter.targets, or LoRA, or export a merged model (adapter.export = 'merge')")
        module = pieces[0][0]
        if len(pieces) == 3:            # q, k, v: diffusers' fused projection (built when it loads the file)
            module = module.rsplit(".", 1)[0] + (".to_qkv" if pieces[0][0].endswith("to_q") else ".to_added_qkv")
        first = "lokr_w1" if "lokr_w1" in f else "lokr_w1_a"
        for name, t in f.items():
            out[f"{PREFIX}{module}.{name}"] = (t.float() * scale if name == first else t.float()).contiguous()
    return out


def export_adapter(checkpoint: str | Path, out: str | Path, weights: str = "auto", overwrite: bool = False) -> dict:
    """Write a checkpoint's adapter (its EMA where the run kept one, by default) in diffusers' format to the folder
    ``out``."""
    from safetensors.torch import save_file

    from difftrain.export import WEIGHTS, _check_out, _publish, _read_metadata, weights_of
    from difftrain.train.adapters import spec_of_checkpoint

    if weights not in ("auto", *WEIGHTS):
        raise UserError(f"export --weights {weights!r}: expected one of auto, {', '.join(WEIGHTS)}")
    info = Checkpointer.read_info(checkpoint)
    ckpt = Path(info["path"])
    weights = weights_of(weights, info)
    if "adapter" not in info:
        raise UserError(f"{ckpt}: this run trained no adapter (adapter.kind = 'none'): export it without --adapter")
    out = Path(out)
    _check_out(out, ckpt, overwrite)
    cfg = from_dict(info["config"], f"{ckpt}/trainer.json")
    spec = spec_of_checkpoint(info)
    prefix = WEIGHTS[weights]
    if prefix == "ema" and not cfg.train.ema_decay:
        raise UserError(f"{ckpt}: no EMA weights in this checkpoint (trained with train.ema_decay = 0): use "
                        "--weights raw")
    metadata = _read_metadata(ckpt)
    tensors = {k[len(prefix) + 1:]: torch.empty(tuple(md.size), dtype=torch.float32)
               for k, md in metadata.state_dict_metadata.items()
               if k.startswith(prefix + ".dit.") and split_name(k) is not None}
    if not tensors:
        raise UserError(f"{ckpt}: no adapter tensors ({prefix}.*lora_*/lokr_*) in this checkpoint")
    Checkpointer.load_tensors(ckpt, prefix, tensors)
    factors: dict[str, dict[str, Tensor]] = {}
    for name, t in tensors.items():
        layer, part = split_name(name)
        factors.setdefault(layer[len("dit."):], {})[part] = t
    m = cfg.model
    sd = to_diffusers_adapter(spec.kind, factors, spec.scale, m.double_blocks, m.single_blocks, m.hidden)
    tmp = out.parent / f"{out.name}.partial-{secrets.token_hex(4)}"
    try:
        tmp.mkdir(parents=True)
        save_file(sd, str(tmp / LORA_WEIGHTS), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(
            {**spec.describe(), "layout": "diffusers", "scale_folded": True, "step": int(info["step"]),
             "weights": weights, "base": info.get("adapter_base")}, indent=1) + "\n")
        _publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "tensors": len(sd), "layers": len(factors), "kind": spec.kind, "step": int(info["step"]),
            "weights": weights, "layout": "diffusers-lora"}


# --- adapters applied at sampling time (sample / eval / candidates --adapter PATH --adapter-scale S) ----------------
MAX_SCALE = 10.0


def read_adapter(path: str | Path, weights: str = "ema") -> tuple[AdapterSpec, dict[str, dict[str, Tensor]], dict]:
    """An adapter from ``path``: a run's ``export/adapter`` folder (adapter_config.json + model.safetensors), or an
    adapter run's checkpoint or run directory (its EMA factors, else the raw ones). Returns (spec, layer ->
    {factor: tensor} by the plain model's layer names without ``dit.``, what it is: path, step, base)."""
    from difftrain.export import WEIGHTS, _read_metadata

    p = Path(path)
    if (p / "adapter_config.json").is_file() and (p / "model.safetensors").is_file():
        from safetensors.torch import load_file

        try:
            conf = json.loads((p / "adapter_config.json").read_text())
            spec = AdapterSpec(conf["kind"], int(conf["rank"]), float(conf["alpha"]), tuple(conf["targets"]))
            tensors = load_file(str(p / "model.safetensors"))
        except Exception as e:  # noqa: BLE001 -- json, safetensors and type errors alike: the folder is unreadable
            raise UserError(f"--adapter {p}: not a readable adapter folder ({type(e).__name__}: {e})") from None
        if spec.kind not in ("lora", "lokr") or spec.rank < 1 or not math.isfinite(spec.alpha):
            raise UserError(f"--adapter {p}/adapter_config.json: kind {spec.kind!r}, rank {spec.rank}, alpha "
                            f"{spec.alpha}: expected lora or lokr, a rank >= 1 and a finite alpha")
        ident = {"path": str(p.resolve()), "base": conf.get("base")}
    else:
        try:
            info = Checkpointer.read_info(p)
        except UserError as e:
            raise UserError(f"--adapter {p}: expected an adapter run's checkpoint or run directory, or its "
                            f"export/adapter folder ({e})") from None
        if "adapter" not in info:
            raise UserError(f"--adapter {p}: {info['path']} trained no adapter (adapter.kind = 'none')")
        from difftrain.train.adapters import spec_of_checkpoint
        spec = spec_of_checkpoint(info)
        cfg = from_dict(info["config"], f"{info['path']}/trainer.json")
        prefix = WEIGHTS[weights] if cfg.train.ema_decay > 0 else "model"
        md = _read_metadata(Path(info["path"])).state_dict_metadata
        tensors = {k[len(prefix) + 1:]: torch.empty(tuple(m.size), dtype=torch.float32) for k, m in md.items()
                   if k.startswith(prefix + ".dit.") and split_name(k) is not None}
        Checkpointer.load_tensors(info["path"], prefix, tensors)
        ident = {"path": info["path"], "step": int(info["step"]), "base": info.get("adapter_base")}
    from difftrain.models.lora import base_name

    factors: dict[str, dict[str, Tensor]] = {}
    for name, t in tensors.items():
        split = split_name(name)
        if split is None or not split[0].startswith("dit."):
            raise UserError(f"--adapter {p}: unexpected tensor {name!r} (an adapter holds dit.*.lora_*/lokr_* only)")
        factors.setdefault(base_name(split[0])[len("dit."):], {})[split[1]] = t.float()
    if not factors:
        raise UserError(f"--adapter {p}: holds no adapter tensors")
    return spec, factors, ident


def diffusers_file(path: str | Path) -> Path | None:
    """The diffusers-format adapter file ``path`` names (a ``.safetensors`` file, or a folder holding
    ``pytorch_lora_weights.safetensors`` and no difftrain ``model.safetensors``), else None."""
    p = Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return p
    if p.is_dir() and (p / LORA_WEIGHTS).is_file() and not (p / "model.safetensors").is_file():
        return p / LORA_WEIGHTS
    return None


def diffusers_updates(path: Path, double_blocks: int, single_blocks: int, hidden: int):
    """A diffusers-format FLUX adapter file (``export --adapter``'s, or another trainer's: keys
    ``[transformer.]<module>.lora_A.weight`` / ``lora_B.weight`` with an optional ``<module>.alpha``, or LoKr's
    ``lokr_*``) as (our layer, first row, the update of those rows) for each piece: diffusers' split q/k/v (and a
    single block's MLP input) land in their rows of our fused layers; the final adaLN's halves are swapped back."""
    from safetensors.torch import load_file

    try:
        sd = load_file(str(path))
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
        raise UserError(f"--adapter {path}: not a readable safetensors file ({e})") from None
    sd = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v.float() for k, v in sd.items()}
    where: dict[str, tuple[str, int, bool]] = {}           # diffusers module -> (our layer, first row, swapped)
    for layer, pieces in _module_plan(double_blocks, single_blocks, hidden).items():
        at = 0
        for module, rows in pieces:
            where[module] = (layer, at, layer == FINAL_ADALN[0])
            at += rows or 0
        if len(pieces) == 3:          # diffusers' fused projection, as LoKr files name it
            fused = pieces[0][0].rsplit(".", 1)[0] + (".to_qkv" if pieces[0][0].endswith("to_q") else ".to_added_qkv")
            where[fused] = (layer, 0, False)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        for part in ("lora_A.weight", "lora_B.weight", "alpha", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b",
                     "lokr_w1", "lokr_w2"):
            if key.endswith("." + part):
                modules.setdefault(key[: -len(part) - 1], {})[part.split(".")[0]] = t
                break
        else:
            raise UserError(f"--adapter {path}: unexpected key {key!r} (expected <module>.lora_A.weight / lora_B.weight "
                            "/ alpha, or lokr_*)")
    for module, f in sorted(modules.items()):
        if module not in where:
            raise UserError(f"--adapter {path}: {module!r} is not a module of this FLUX transformer (another "
                            "architecture, or other block counts?)")
        layer, row, swapped = where[module]
        try:
            d = _diffusers_update(f)
        except (RuntimeError, KeyError, IndexError, ValueError) as e:
            raise UserError(f"--adapter {path}: {module!r} holds no usable adapter ({sorted(f)}: {type(e).__name__}: "
                            f"{e})") from None
        if d.dim() != 2 or not bool(torch.isfinite(d).all()):
            raise UserError(f"--adapter {path}: {module!r}'s update is not a finite matrix")
        yield layer, row, (_swap_halves(d) if swapped else d)


def _diffusers_update(f: dict[str, Tensor]) -> Tensor:
    """One module's update from a diffusers-format file: LoRA B @ A at alpha / rank (1 without alpha); LoKr
    kron(w1, w2), at alpha / rank where a factor is rank-decomposed (the LyCORIS rule; full factors take no alpha)."""
    alpha = f.get("alpha")
    if alpha is not None and alpha.numel() != 1:
        raise ValueError(f"alpha of {alpha.numel()} values")
    if "lora_A" in f or "lora_B" in f:
        rank = f["lora_A"].shape[0]
        return (float(alpha) / rank if alpha is not None else 1.0) * (f["lora_B"] @ f["lora_A"])
    w1 = f["lokr_w1"] if "lokr_w1" in f else f["lokr_w1_a"] @ f["lokr_w1_b"]
    w2 = f["lokr_w2"] if "lokr_w2" in f else f["lokr_w2_a"] @ f["lokr_w2_b"]
    rank = f["lokr_w2_a"].shape[1] if "lokr_w2_a" in f else f["lokr_w1_a"].shape[1] if "lokr_w1_a" in f else None
    scale = float(alpha) / rank if alpha is not None and rank else 1.0
    return scale * torch.kron(w1, w2)


def fold_adapters(dit: torch.nn.Module, adapters: list[tuple[str, float]], weights: str = "ema") -> list[dict]:
    """Fold each adapter, at its scale, into the DiT's weights in place (W += scale * update; plain or sharded
    weights), so that any number of them sample at the cost of none. Every adapted layer must exist in this model
    with the adapter's shapes (refused naming the layer otherwise). Returns what was applied."""
    from difftrain.models.lora import base_name, delta

    params = {base_name(k): v for k, v in dit.named_parameters()}
    applied = []
    for path, scale in adapters:
        file = diffusers_file(path)
        if file is not None:                 # diffusers' LoRA / LoKr format (ours from export --adapter, or another's)
            p, n = dit.params, 0
            for layer, row, d in diffusers_updates(file, p.double_blocks, p.single_blocks, p.hidden):
                _add_rows(params, path, layer, row, scale * d)
                n += 1
            applied.append({"path": str(file.resolve()), "scale": scale, "layout": "diffusers", "modules": n})
            continue
        spec, factors, ident = read_adapter(path, weights)
        for layer in sorted(factors):
            w = params.get(f"{layer}.weight")
            if w is None:
                raise UserError(f"--adapter {path}: adapts {layer!r}, which this model does not have (an adapter "
                                "of another architecture?)")
            try:
                d = delta(spec.kind, factors[layer], spec.scale * scale, tuple(w.shape))
            except (RuntimeError, KeyError, IndexError, ValueError) as e:
                raise UserError(f"--adapter {path}: its factors for {layer!r} ({sorted(factors[layer])}) do not make "
                                f"an update of the layer's weight {list(w.shape)} ({type(e).__name__}: {e})") from None
            if tuple(d.shape) != tuple(w.shape):
                raise UserError(f"--adapter {path}: its update of {layer!r} is {list(d.shape)}, the layer's weight "
                                f"{list(w.shape)}")
            if not bool(torch.isfinite(d).all()):
                raise UserError(f"--adapter {path}: its update of {layer!r} holds NaN or infinite values")
            _add_rows(params, path, layer, 0, d)
        applied.append({**ident, "scale": scale, "kind": spec.kind, "rank": spec.rank, "layers": len(factors)})
    return applied


def parse_adapter_args(paths: list[str] | None, scales: list[float] | None) -> list[tuple[str, float]]:
    """``--adapter PATH`` (repeated) with ``--adapter-scale S``: none (1 each), one for all, or one per adapter;
    each finite and within [-10, 10]."""
    import math

    paths, scales = list(paths or []), list(scales or [])
    if scales and not paths:
        raise UserError("--adapter-scale without --adapter: name the adapter to scale")
    if len(scales) not in (0, 1, len(paths)):
        raise UserError(f"--adapter-scale given {len(scales)} times for {len(paths)} adapters: give one scale for "
                        "all, or one per --adapter")
    for s in scales:
        if not math.isfinite(s) or abs(s) > MAX_SCALE:
            raise UserError(f"--adapter-scale {s}: expected a finite strength within [-{MAX_SCALE:g}, {MAX_SCALE:g}]")
    scales = scales or [1.0]
    return [(p, scales[i] if len(scales) > 1 else scales[0]) for i, p in enumerate(paths)]


def _add_rows(params: dict, path, layer: str, row: int, d: Tensor) -> None:
    """Add ``d`` to rows [row, row + len(d)) of ``layer``'s weight (plain or sharded), checking the shapes."""
    from difftrain.parallel.fsdp import write_param

    w = params.get(f"{layer}.weight")
    if w is None:
        raise UserError(f"--adapter {path}: adapts {layer!r}, which this model does not have")
    if type(w.data) is not torch.Tensor and not hasattr(w, "full_tensor"):
        raise UserError(f"--adapter {path}: {layer!r} of this model is quantized: adapters fold into full-precision "
                        "weights")
    full = w.detach().full_tensor() if hasattr(w, "full_tensor") else w.detach()
    if full.dim() != 2 or d.shape[1] != full.shape[1] or row + d.shape[0] > full.shape[0]:
        raise UserError(f"--adapter {path}: an update of {list(d.shape)} at row {row} does not fit {layer!r}'s weight "
                        f"{list(full.shape)}")
    new = full.float().clone()
    new[row:row + d.shape[0]] += d.to(new.device)
    with torch.no_grad():
        write_param(w.detach(), new.to(full.dtype))
