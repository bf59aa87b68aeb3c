"""What a run with adapters adds to the trainer: the adapters injected before wrapping, the base's identity, and
checkpoints that hold the adapters alone.

With an adapter (``[adapter]``, or DPO's ``dpo.reference = 'lora'``) the DiT's base weights and the text encoder are
frozen; the base is read again from where it came from on every start (``model.init_from``, DPO's ``dpo.init``, or
the seeded initialisation), and its digest is kept in every checkpoint and checked on resume, so an adapter is never
resumed onto another base. A checkpoint then holds the adapters, their optimizer state and EMA: at rank 16 on
FLUX.1-dev some 0.2 GB instead of 12B parameters' weights and Adam moments.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from torch import nn

from difftrain.config import Config
from difftrain.errors import UserError
from difftrain.models.lora import AdapterSpec, apply_adapter, file_digest, is_adapter

log = logging.getLogger("difftrain.train")


def check_adapter_config(cfg: Config, dpo: bool = False) -> AdapterSpec | None:
    """The run's adapter after the checks that need no model (each refusal one line naming the key)."""
    a = cfg.adapter
    if dpo and a.kind != "none" and cfg.dpo.reference != "lora":
        raise UserError(f"adapter.kind = {a.kind!r} with dpo.reference = 'copy': a DPO run with adapters takes its "
                        "base as the reference; set dpo.reference = 'lora' (the adapter is [adapter]'s)")
    if cfg.train.fp8 != "none" and a.kind != "none":
        raise UserError(f"train.fp8 = {cfg.train.fp8!r} with adapter.kind = {a.kind!r}: float8 training converts the "
                        "linears an adapter wraps: train the adapter with train.fp8 = 'none'")
    if a.base_precision != "bf16" and AdapterSpec.of(cfg, dpo) is None:
        raise UserError(f"adapter.base_precision = {a.base_precision!r} with adapter.kind = 'none': only a frozen "
                        "base is quantized; set adapter.kind = 'lora' or 'lokr'")
    spec = AdapterSpec.of(cfg, dpo)
    if spec is not None and a.base_precision != "bf16":
        if cfg.parallel.cpu_offload:
            raise UserError(f"adapter.base_precision = {a.base_precision!r} with parallel.cpu_offload: FSDP's offload "
                            "leaves the quantized base (not sharded) on the host; train without offload (an nf4 base "
                            "is a quarter of a bf16 one)")
        if cfg.train.compile:
            raise UserError(f"adapter.base_precision = {a.base_precision!r} with train.compile: compiling the "
                            "quantized base's layers is not supported yet; set train.compile = false")
    if spec is not None and spec.export == "merge" and a.base_precision != "bf16":
        raise UserError(f"adapter.export = 'merge' with adapter.base_precision = {a.base_precision!r}: a merged model "
                        "would carry the quantized base's error; export the adapter ('adapter') and fold it into the "
                        "full-precision base (sample --adapter, or difftrain export --adapter for diffusers)")
    if spec is not None and not dpo and not cfg.model.init_from:
        raise UserError(f"adapter.kind = {spec.kind!r} without model.init_from: an adapter trains on a frozen base; "
                        "set model.init_from to it (a diffusers FLUX transformer folder or a difftrain export)")
    return spec


def adapt(cfg: Config, model: nn.ModuleDict, spec: AdapterSpec | None) -> list[str]:
    """Inject the adapter into the DiT built on the meta device (before it is wrapped) and freeze the rest: the
    DiT's base and a trained text encoder. Returns the adapted layers' names ([] without an adapter)."""
    if spec is None:
        return []
    names = apply_adapter(model["dit"], spec)
    if "text" in model:
        model["text"].requires_grad_(False)
        if getattr(model["text"], "new_words", None) is not None:     # words the base never saw: trained
            model["text"].new_words.requires_grad_(True)
    return names


def base_quantized(dit: nn.Module, cfg: Config, spec: AdapterSpec | None, device) -> dict:
    """The base's block linears to quantize (``adapter.base_precision`` fp8 or nf4; {} otherwise), after a trial
    on this device: by their weight's plain name."""
    precision = cfg.adapter.base_precision
    if spec is None or precision == "bf16":
        return {}
    from difftrain.models.base_quant import base_layers, check_base_precision

    check_base_precision(precision, device)
    return base_layers(dit, precision)


def frozen_to_bf16(dit: nn.Module, quantized: set[str]) -> int:
    """Under bf16 autocast the frozen base needs no fp32 master copy: its parameters (on the meta device, before
    wrapping) become bf16, the adapters stay fp32 (FSDP2 wants one dtype among trainable parameters only; the
    all-gather casts every parameter to bf16 anyway). Layers to quantize are left as they are. Returns the
    parameters cast."""
    import torch

    from difftrain.models.lora import base_name

    n = 0
    for prefix, module in dit.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            full = f"{prefix}.{name}" if prefix else name
            if p.requires_grad or base_name(full) in quantized or p.dtype != torch.float32:
                continue
            setattr(module, name, nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False))
            n += 1
    return n


def base_digest(cfg: Config, run_dir: Path, is_main: bool) -> dict:
    """The frozen base's identity: the files of ``model.init_from`` (sha256 of each file's content, kept in
    ``RUN/base_digest.json`` by size and mtime so that a restart does not read a 24 GB base again). Rank 0 reads the
    files; every rank gets its answer."""
    from difftrain.parallel.dist import gather_objects

    out = None
    if is_main:
        try:
            out = _files_digest(cfg.model.init_from, run_dir)
        except (UserError, OSError) as e:         # every rank ends with it, none waits in the gather below
            out = {"error": f"model.init_from = {cfg.model.init_from!r}: {e}"}
    out = gather_objects(out)[0]
    if "error" in out:
        raise UserError(out["error"])
    return out


def _files_digest(init_from: str, run_dir: Path) -> dict:
    from difftrain.parallel.pretrained import _resolve

    src = _resolve(Path(init_from))
    cache_path = run_dir / "base_digest.json"
    try:
        cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        cache = {}
    cache = {k: v for k, v in cache.items() if isinstance(v, list) and len(v) == 3} if isinstance(cache, dict) else {}
    digest = file_digest(src.files, cache)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(cache, indent=1))
    except OSError as e:
        log.warning("%s: the base's file digests are not cached (%s); a restart reads the base again", cache_path, e)
    return {"source": str(src.root), "digest": digest}


def check_same_base(saved: dict | None, now: dict, checkpoint: Path) -> None:
    """A resume onto another base than the one the adapters were trained on is refused, naming both."""
    if saved is None:
        raise UserError(f"{checkpoint}: this checkpoint records no adapter base (written by a run without an "
                        "adapter, or an older difftrain): resume it with adapter.kind = 'none'")
    if saved.get("digest") != now["digest"]:
        raise UserError(f"{checkpoint}: its adapters were trained on the base {saved.get('source')!r} (digest "
                        f"{str(saved.get('digest'))[:12]}), and this run's base {now['source']!r} has digest "
                        f"{now['digest'][:12]}: point model.init_from at the base the adapters were trained on")


def keep_in_checkpoint(model: nn.Module):
    """The predicate of the model tensors a checkpoint holds: with an adapter, all but the DiT's frozen base (read
    again from where it came from); a frozen text encoder trained with the model (``words``) is kept, it is small
    and not in the base's files. Without an adapter: every tensor (None)."""
    names = [n for n, _ in model.named_parameters()]
    if not any(is_adapter(n) for n in names):
        return None
    base = {n for n, p in model.named_parameters() if n.startswith("dit.") and not is_adapter(n)}
    return lambda name: name not in base


def spec_of_checkpoint(info: dict) -> AdapterSpec:
    """The adapter a checkpoint's run trained (its ``adapter`` record)."""
    a = info["adapter"]
    return AdapterSpec(a["kind"], int(a["rank"]), float(a["alpha"]), tuple(a["targets"]), 0.0)


def load_base(model: nn.ModuleDict, cfg: Config, info: dict, device=None) -> dict:
    """Read an adapter run's frozen base into ``model`` (adapters injected, plain or sharded) from where the run
    read it: DPO's starting checkpoint or ``model.init_from``; refused, naming both, when
    the base found there is not the one the adapters were trained on. Returns the adapters' tensors by name (and the
    rows of words the adapter learnt, ``text.new_words``), for the checkpoint's EMA or raw values to be read into.
    A DiT on the meta device (a quantized base) is allocated on ``device`` but for the layers to quantize, each
    allocated as its first rows are read: the base is never whole in full precision there."""
    from difftrain.models.lora import base_name
    from difftrain.train.checkpoint import Checkpointer

    saved = info.get("adapter_base") or {}
    dit = model["dit"]
    precision = cfg.adapter.base_precision
    layers = {}
    if precision != "bf16":                  # the base the adapters were trained on: quantized as it was, as read
        from difftrain.models.base_quant import base_layers, quantize_layer
        for name, p in dit.named_parameters():
            p.requires_grad_(is_adapter(name))
        layers = base_layers(dit, precision)
    lazy = any(p.is_meta for p in dit.parameters())
    if lazy:
        if device is None:
            raise ValueError("load_base: a DiT on the meta device needs the device to allocate it on")
        from difftrain.models.base_quant import to_empty_but
        to_empty_but(dit, layers, device)

    def materialize(name: str) -> torch.Tensor:
        from difftrain.models.base_quant import allocate
        return allocate(layers[name], device)

    def quantize(name: str) -> None:
        if name in layers:
            quantize_layer(layers[name], precision)

    if "dpo" in info:
        from difftrain.train.dpo import reference_digest
        start = Checkpointer.read_info(info["dpo"]["init"])
        now = {"source": start["path"], "digest": reference_digest(start, info["dpo"]["weights"])}
        check_same_base(saved, now, Path(info["path"]))
        if lazy:                             # a checkpoint's reader wants every tensor allocated
            for name in layers:
                materialize(name)
        Checkpointer.load_tensors(start["path"], info["dpo"]["weights"],
                                  {base_name(k): v.detach() for k, v in model.named_parameters() if not is_adapter(k)})
        for name in list(layers):
            quantize(name)
    else:
        run_dir = Path(info["path"]).parent.parent
        check_same_base(saved, base_digest(cfg, run_dir, _is_main()), Path(info["path"]))
        from difftrain.parallel.pretrained import load_pretrained
        load_pretrained(dit, cfg.model.init_from, on_loaded=quantize, materialize=materialize if lazy else None)
    trained = {k: v.detach() for k, v in model.named_parameters() if is_adapter(k) or k == "text.new_words"}
    rest = {k: v.detach() for k, v in model.named_parameters() if not k.startswith("dit.") and k not in trained}
    if rest:                                 # a trained word encoder, frozen under the adapter: the checkpoint's
        Checkpointer.load_tensors(info["path"], "model", rest)
    return trained                           # the adapters and the words they learnt (EMA or raw, as asked)


def _is_main() -> bool:
    from difftrain.parallel.dist import rank_world
    return rank_world()[0] == 0
