"""Load a checkpoint for inference and generate from user inputs (``difftrain sample``)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from difftrain.config import Config, from_dict
from difftrain.data.batch import Batch, assemble
from difftrain.shapes.loader import to_tensor
from difftrain.diffusion.flow import FlowSpec
from difftrain.diffusion.pipeline import Pipeline, amp_dtype, pick_device
from difftrain.errors import UserError
from difftrain.models import build_autoencoder, build_text_encoder
from difftrain.train.build import Weights, build_model, sampler_config
from difftrain.train.checkpoint import Checkpointer

log = logging.getLogger("difftrain")


def guidance_scale(cfg: Config, requested: float | None) -> float:
    """The CFG scale to sample with: ``requested``, else ``sample.cfg_scale``. Guidance needs an
    unconditional prediction, which only caption dropout trains: with ``data.caption_dropout = 0`` a scale
    other than 1 is warned about (it extrapolates from an untrained prediction)."""
    scale = cfg.sample.cfg_scale if requested is None else float(requested)
    if scale != 1.0 and cfg.data.caption_dropout == 0.0:
        log.warning("cfg scale %g with data.caption_dropout = 0: the model's unconditional prediction is not "
                    "trained, so guidance extrapolates from an untrained prediction; sample with a cfg scale of 1",
                    scale)
    return scale


def load_pipeline(checkpoint: str | Path, device: torch.device | None = None, use_ema: bool = True,
                  quant: str | None = None, guidance: float | None = None,
                  adapters: list[tuple[str, float]] = ()) -> tuple[Pipeline, Config, dict]:
    """A ready pipeline from a checkpoint directory (or a run directory, or ``.../checkpoints/latest``),
    with the EMA weights when the run kept them. ``quant`` ("fp8" | "mxfp8" | "nvfp4"): the DiT's block linears
    quantized for inference (``models.quant``; the model then runs in bf16), described in ``info["quant"]``.
    ``guidance``: the embedded guidance of a guidance-distilled model (default: the run's ``sample.guidance``).
    ``adapters``: (path, scale) of adapters folded into the weights before sampling (``adapter_export.fold_adapters``;
    before ``quant``), described in ``info["adapters"]``."""
    if guidance is not None and not 0 < guidance <= 100:
        raise UserError(f"--guidance {guidance}: expected a scale in (0, 100] (FLUX.1-dev: 3.5)")
    if quant is not None:
        from difftrain.models.quant import check_format
        check_format(quant)
    info = Checkpointer.read_info(checkpoint)
    cfg = from_dict(info["config"], f"{info['path']}/trainer.json")
    if "padding" not in info["config"].get("text", {}):
        log.warning("%s was trained before text.padding existed (its text encoder attended padding to each batch's "
                    "longest caption); it is sampled under text.padding = %r, which it was not trained for",
                    info["path"], cfg.text.padding)
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if sharded and quant:
        raise UserError(f"--quant {quant} samples on one device: a quantized model is not sharded over ranks "
                        "(launch without torchrun, or without --quant)")
    adapted = "adapter" in info              # a run with an adapter: its checkpoint holds the adapters alone
    if adapted and cfg.adapter.base_precision != "bf16" and sharded:
        raise UserError(f"{info['path']}: trained on an {cfg.adapter.base_precision} base, which samples on one device "
                        "(the quantized base is not sharded): launch without torchrun")
    env = None
    if sharded:                                  # under torchrun: the model sharded over the ranks (FSDP2)
        from difftrain.parallel.dist import init_distributed
        env = init_distributed(sampler_config(cfg, int(os.environ["WORLD_SIZE"])))
        device = env.device
    device = device or pick_device()
    ae = build_autoencoder(cfg.autoencoder.kind, cfg.autoencoder.factor, cfg.autoencoder.path,
                           cfg.autoencoder.scaling, cfg.autoencoder.shift)
    vocab = info.get("text_encoder", {}).get("vocabulary")
    text = build_text_encoder(cfg, vocab, device, base_words=int(info.get("text_encoder", {}).get("base_words", 0)))
    spec = None
    if adapted:
        from difftrain.train.adapters import spec_of_checkpoint
        spec = spec_of_checkpoint(info)
    # the factory: built on the meta device, the checkpoint's weights read into the model's own parameters (each
    # rank's shards, when sharded: one copy of the model, not two); a quantized base read a layer at a time
    prefix = "ema" if use_ema and cfg.train.ema_decay > 0 else "model"
    model = build_model(cfg, "sampler", device=device, text_encoder=text, autoencoder=ae, env=env, adapter=spec,
                        weights=Weights.checkpoint(info["path"], prefix, info)).model
    if adapters:
        from difftrain.adapter_export import fold_adapters
        info = {**info, "adapters": fold_adapters(model["dit"], list(adapters), "ema" if use_ema else "raw")}
        if cfg.text.kind == "words":             # words an adapter learnt (export/adapter/words/) join the vocabulary
            from difftrain.parallel.words_init import adapter_words, with_adapter_words
            for path, _ in adapters:
                found = adapter_words(path)
                if found is not None:
                    text = with_adapter_words(text, path, *found)
                    if "text" in model:
                        model["text"] = text
    amp = amp_dtype(cfg.train.precision, device)
    if quant:
        from difftrain.models.quant import quantize_dit
        info = {**info, "quant": quantize_dit(model["dit"], quant, device)}
        amp = torch.bfloat16                     # around the quantized layers, the model runs in bf16
    _install_attention(cfg, model, device, info, amp)
    pipe = Pipeline(model, text, ae.to(device), FlowSpec.from_config(cfg.diffusion), device, amp,
                    guidance=cfg.sample.guidance if guidance is None else guidance,
                    sample_shift=(cfg.sample.shift, cfg.sample.shift_value))
    return pipe, cfg, info


def _install_attention(cfg: Config, model, device: torch.device, info: dict, amp: torch.dtype | None) -> None:
    """The run's attention kernel for sampling: a named backend as in training (checked for inference); 'auto'
    the hybrid the run tuned (its cache), or SDPA's own choice when there is none."""
    from difftrain.parallel.tune import cache_key, dtype_name, install, load_cache

    if cfg.attention.backend != "auto":
        install(cfg, model, device, amp, False, 1)
        return
    from difftrain.models.attention import set_kernel
    from difftrain.models.kernels import HybridKernel

    run_dir = Path(info["path"]).parent.parent
    cache = cfg.attention.cache or str(run_dir / "attention_tune.json")
    shapes = load_cache(cache, cache_key(device, dtype_name(amp), True))
    if shapes:
        set_kernel(model, HybridKernel({k: r["winner"] for k, r in shapes.items()}))


def request_batch(pipe: Pipeline, cfg: Config, prompts: list[str], edit_image=None, frames: int | None = None) -> Batch:
    """The batch that ``sample`` fills in: t2i (default), editing (``edit_image`` as reference at index 1)
    or ``frames`` keyframes (all generated)."""
    if frames is not None and frames < 1:
        raise UserError(f"--frames {frames}: expected a number of keyframes >= 1")
    if frames is not None and edit_image is not None:
        raise UserError("--frames and --edit cannot be combined: a request is one task")
    ae, size, B = pipe.autoencoder, cfg.data.image_size, len(prompts)
    if edit_image is not None:
        ref = ae.encode(to_tensor(edit_image[None]).to(pipe.device)).expand(B, -1, -1, -1)
        lat = torch.stack((torch.zeros_like(ref), ref), dim=1)
        tokens = pipe.text_encoder.tokenize(prompts)
        return assemble(lat, [0, 1], torch.tensor([[True, False]] * B), tokens, prompts, "edit")
    return pipe.blank_batch(prompts, size, size, frames or 1, "keyframes" if frames else "t2i")
