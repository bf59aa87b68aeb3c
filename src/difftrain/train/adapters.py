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
    """The run's adapter (``dpo``: a ``difftrain dpo`` run, whose LoRA reference is one). What cannot be built is
    refused when the config is read (``config.refusals``, run by ``load_config`` and ``config show``); a config made in
    code is checked the same way here. What only the verb decides is checked here alone."""
    from difftrain.config.refusals import check_buildable

    check_buildable(cfg)
    spec = AdapterSpec.of(cfg, dpo)
    if spec is not None and not dpo and not cfg.model.init_from:      # a DPO config trained by 'difftrain train'
        raise UserError(f"adapter.kind = {spec.kind!r} without model.init_from, under 'difftrain train' (dpo.init is "
                        "read by 'difftrain dpo' only): set model.init_from to the base, or run 'difftrain dpo'")
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
