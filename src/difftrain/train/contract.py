"""What the trainer and an objective agree on, so that neither reaches into the other: the ``Denoiser`` an objective
calls (the trainable model on one micro-batch), the ``MicroLoss`` it returns, the ``Objective`` protocol, and the
hooks an objective may add to a run around its loss (``RunHooks``: where its policy's weights come from, what it
builds beside the policy, what it keeps in a checkpoint, when it stops), given a ``RunView`` of the run. The trainer
imports this module and no objective's; an objective's module never imports the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from difftrain.config import Config
from difftrain.data.batch import Batch
from difftrain.diffusion.pipeline import autocast
from difftrain.models.text import TextEmbedding, real_lengths
from difftrain.parallel.cp import shard_sequence
from difftrain.parallel.flops import step_flops
from difftrain.train.build import Weights


@dataclass
class MicroLoss:
    loss: Tensor          # this micro-batch's contribution to the step's loss (already divided by the global count)
    tokens: int           # real (unpadded) tokens it trained on
    flops: float          # its training FLOPs
    stats: Tensor | None = None   # per-example statistics the objective logs (rows gathered over ranks), detached


class Denoiser:
    """The trainable model as objectives call it: the DiT on one micro-batch, with its text embedded (stored
    states of frozen encoders, or the trained word encoder), under autocast, and, with context parallelism,
    on this rank's 1/cp of every sequence (padding masked out of attention)."""

    def __init__(self, model: nn.ModuleDict, text_encoder: nn.Module, device: torch.device,
                 amp: torch.dtype | None, cp: int = 1, cp_rank: int = 0, padding: str = "masked"):
        self.dit, self.text_encoder = model["dit"], text_encoder
        self.device, self.amp, self.cp, self.cp_rank = device, amp, cp, cp_rank
        self.masked = padding == "masked"      # text.padding: mask padding out of the DiT's attention

    def on_device(self, batch: Batch) -> Batch:
        b = batch.to(self.device, non_blocking=True)
        b.x0_BLC = b.x0_BLC.float()      # the store serves bf16 latents as stored; widened on the device
        return b

    def embed_text(self, b: Batch) -> TextEmbedding:
        if b.text is not None:           # embeddings of frozen encoders, read from the latent store
            return b.text
        with autocast(self.device, self.amp):
            return self.text_encoder(b.tokens)

    def local(self, x_BL: Tensor, fill: float | bool = 0) -> Tensor:
        """This rank's part of a per-image-token tensor (the tensor itself without context parallelism)."""
        return shard_sequence(x_BL, self.cp, self.cp_rank, fill)

    def __call__(self, b: Batch, xt_BLC: Tensor, t_B: Tensor, emb: TextEmbedding) -> tuple[Tensor, Tensor]:
        """The DiT's output on noisy tokens ``xt``, and ``xt`` as this rank holds it (``local``)."""
        B = len(b)
        # Guidance-distilled models (FLUX.1-dev) are fine-tuned with the embedded guidance at 1.
        g = torch.ones(B, device=self.device) if self.dit.params.guidance_embed else None
        txt, img_mask, ids, extent = emb.txt_BTD, None, b.ids_BL3, None
        txt_mask = emb.mask_BT.to(self.device, non_blocking=True) if self.masked else None
        if self.cp > 1:       # a rank holds part of each grid: 'centre' positions need the whole grid's extent
            extent = b.ids_BL3[..., 1:].amax(dim=1) + 1
            keep_t = txt_mask if txt_mask is not None else torch.ones(txt.shape[:2], dtype=torch.bool,
                                                                       device=self.device)
            ones_i = torch.ones(xt_BLC.shape[:2], dtype=torch.bool, device=self.device)
            txt, txt_mask = self.local(txt), self.local(keep_t, False)
            xt_BLC, ids, img_mask = self.local(xt_BLC), self.local(ids), self.local(ones_i, False)
        with autocast(self.device, self.amp):
            out = self.dit(xt_BLC, ids, txt, t_B, emb.pooled_BP, g, txt_mask_BT=txt_mask, img_mask_BL=img_mask,
                           img_extent_B2=extent)
        return out, xt_BLC

    def cost(self, batch: Batch) -> tuple[int, float]:
        """(real tokens, training FLOPs) of one forward/backward pass over the micro-batch, from its host-side
        tensors (no device sync): the text positions the DiT attends ('masked': real tokens; 'padded': all)."""
        L = batch.x0_BLC.shape[1]
        if batch.text is not None:
            T, lengths = batch.text.mask_BT.shape[1], batch.text.mask_BT.sum(1)
        else:
            first = next(iter(batch.tokens.values()))
            T, lengths = first.shape[1], real_lengths(batch.tokens)
        txt_real = lengths.tolist() if self.masked else [T] * len(batch)
        flops = step_flops(self.dit.params, [(L, int(n)) for n in txt_real])
        return len(batch) * L + int(sum(txt_real)), float(flops)


class Objective(Protocol):
    name: str
    batch_kind: str        # what the data source must serve ("samples"; a pair objective asks for "pairs")

    def count(self, batch: Batch) -> float:
        """The unit the step's loss is divided by, in this micro-batch (summed over micro-batches and ranks)."""

    def loss(self, model: Denoiser, batch: Batch, seed: int, step: int, normalizer: float | Tensor) -> MicroLoss:
        """One micro-batch's loss contribution, for optimizer step ``step`` (0-based)."""

    def metrics(self, loss: float, task: str, stats: Tensor | None = None) -> dict[str, float]:
        """The values it logs for a step, by name, from the step's reduced loss; an objective whose ``MicroLoss``
        carries ``stats`` is also given their rows from every micro-batch and rank (others are called with two
        arguments, as before)."""


@dataclass
class RunView:
    """What an objective's hooks see of a run: its config and mesh, the policy as built, its encoders, its data
    source's loader, where it logs. Given to ``RunHooks.attach`` once the policy and the loader exist."""
    cfg: Config
    env: Any                          # parallel.dist.ParallelEnv
    device: torch.device
    amp: torch.dtype | None
    run_dir: Path
    model: nn.ModuleDict
    text_encoder: nn.Module
    autoencoder: nn.Module
    denoiser: Denoiser
    loader: Any
    metrics: Any                      # train.metrics.MetricsLogger: .log(step, values), .event(kind, step, **info)
    adapter: Any = None               # models.lora.AdapterSpec of the run, or None
    quantized: dict | None = None     # the quantized base's layers by weight name ({} without)


class RunHooks:
    """What an objective may add to a run around its loss. The defaults are a plain run's (flow matching): weights
    from ``model.init_from`` (or the seed), the config's ``[adapter]``, the base's file digest kept in checkpoints."""

    starts_from_checkpoint = False    # the policy's weights are a difftrain checkpoint's (DPO's dpo.init)

    def adapter_spec(self, cfg: Config):
        """The run's adapter (``models.lora.AdapterSpec``) or None, after the checks that need no model."""
        from difftrain.train.adapters import check_adapter_config
        return check_adapter_config(cfg)

    def start_weights(self, cfg: Config) -> Weights:
        """Where the policy's weights come from on a fresh start (and, with an adapter, its frozen base on every
        start)."""
        return Weights.base(cfg.model.init_from) if cfg.model.init_from else Weights.seed()

    def adapter_base(self, cfg: Config, run_dir: Path, is_main: bool) -> dict:
        """The frozen base's identity, kept in every checkpoint of an adapter run and checked on resume."""
        from difftrain.train.adapters import base_digest
        return base_digest(cfg, run_dir, is_main)

    def attach(self, run: RunView) -> None:
        """Called once the policy, its denoiser and the loader are built (DPO builds its reference here)."""

    def extra_state(self) -> dict:
        """More state for the checkpoint's metadata."""
        return {}

    def check_resume(self, info: dict, path: Path) -> None:
        """Refuse a checkpoint this objective cannot continue (before anything is read from it)."""

    def load_state(self, info: dict) -> None:
        """Take back what ``extra_state`` saved."""

    def stop_early(self, run: RunView, step: int) -> bool:
        """After a step (logged and checkpointed as due): end the run now. Every rank must return the same."""
        return False
