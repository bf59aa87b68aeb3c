"""``difftrain dpo``: Diffusion-DPO on the trainer (``Trainer`` with the ``DiffusionDPO`` objective).

The run starts from ``dpo.init`` (a difftrain checkpoint; its EMA weights with ``dpo.use_ema``) and trains on
``dpo.pairs``. The config's model, text encoder, autoencoder and diffusion sections must be the checkpoint's
(refused before any work otherwise, naming the keys). The reference is a frozen copy of the starting weights,
built and sharded as the policy is (FSDP2 over the same mesh, blocks resharded after their forward; bf16
weights on GPUs), with no optimizer state and no EMA; its digest (of the starting checkpoint's file checksums
and the weights taken) is in every checkpoint and checked on resume. Validation: every ``dpo.validation_every``
steps the implicit accuracy over the pairs file's validation split (the same t and noise every pass), logged
as ``val_implicit_acc``; with ``dpo.patience`` the run stops once it has not improved for that many passes.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from torch import nn

from difftrain.config import Config, to_dict
from difftrain.diffusion.flow import FlowSpec
from difftrain.errors import UserError
from difftrain.models import build_dit, build_text_encoder, dit_params
from difftrain.models.lora import adapters_disabled, base_name, is_lora
from difftrain.parallel import parallelize
from difftrain.parallel.dist import all_reduce_sum
from difftrain.train.checkpoint import Checkpointer
from difftrain.train.objectives import Denoiser, DiffusionDPO
from difftrain.train.trainer import Trainer

log = logging.getLogger("difftrain.train")

# Sections a DPO run takes from its starting checkpoint unchanged: what the weights mean.
SAME_AS_INIT = ("model", "text", "autoencoder", "diffusion")


def check_dpo_config(cfg: Config) -> dict:
    """The starting checkpoint's metadata, after the checks that need no model: ``dpo.init`` and ``dpo.pairs``
    set, no context parallelism, the architecture the checkpoint's."""
    d = cfg.dpo
    if not d.init:
        raise UserError("dpo.init is empty: set it to the checkpoint DPO starts from (a run directory or a "
                        "checkpoint directory)")
    if not d.pairs:
        raise UserError("dpo.pairs is empty: set it to the pairs file 'difftrain pairs' wrote")
    if cfg.parallel.cp != 1:
        raise UserError(f"parallel.cp = {cfg.parallel.cp}: DPO compares whole samples' errors; use cp = 1")
    info = Checkpointer.read_info(d.init)
    theirs, ours = info.get("config", {}), to_dict(cfg)
    diff = [f"{sec}.{k}: checkpoint {theirs.get(sec, {}).get(k)!r}, config {v!r}"
            for sec in SAME_AS_INIT for k, v in ours[sec].items() if theirs.get(sec, {}).get(k, v) != v]
    if diff:
        raise UserError(f"dpo.init = {d.init!r} is another architecture than this config: {'; '.join(diff[:6])}"
                        f"{' ...' if len(diff) > 6 else ''}. Copy those sections from the checkpoint's "
                        f"config ({info['path']}/trainer.json)")
    return info


def reference_digest(info: dict, weights: str) -> str:
    """The starting checkpoint's identity: its completion marker (every file's size and checksum) and which of
    its weights were taken."""
    from difftrain.train.verification import checkpoint_digest

    return hashlib.sha256(f"{checkpoint_digest(info['path'])}:{weights}".encode()).hexdigest()


class PairsSource:
    """The data source of a DPO run (``ConfiguredSource``'s interface): the encoded pairs file."""

    per_bucket_batches = False
    batch_kinds = ("pairs",)

    def __init__(self, cfg: Config, init_info: dict):
        self.cfg, self.init_info = cfg, init_info

    def vocabulary(self) -> list[str]:
        vocab = self.init_info.get("text_encoder", {}).get("vocabulary")
        if self.cfg.text.kind == "words" and not vocab:
            raise UserError(f"{self.init_info['path']}: the checkpoint records no word vocabulary")
        return vocab

    @property
    def base_words(self) -> int:
        """How many of the vocabulary's words the starting checkpoint's encoder holds in its base rows."""
        return int(self.init_info.get("text_encoder", {}).get("base_words", 0))

    def preview_prompts(self, n: int) -> list[str] | None:
        return None

    def build(self, autoencoder, text_encoder, rank: int = 0, num_ranks: int = 1, device="cpu", micro_batch: int = 0):
        from difftrain.data.store.pairs import EncodedPairs
        from difftrain.data.store.pairs_loader import PairsLoader
        from difftrain.data.store.tables import encoder_identity

        # The store's cache key: the encoders' identity (the text rule included) and how latents are kept.
        settings = {**encoder_identity(self.cfg), "latent_dtype": self.cfg.data.latent_dtype}
        frozen = None if getattr(text_encoder, "trainable", False) else text_encoder
        # Rank 0 encodes (or finds the cache) and says whether it could; the others then read its cache: one
        # writer, and a bad pairs file stops every rank at once (the others with a pointer to rank 0's error).
        import torch.distributed as dist

        from difftrain.parallel.dist import broadcast_int

        if not dist.is_initialized():
            pairs = EncodedPairs.load_or_encode(self.cfg.dpo.pairs, autoencoder, settings, frozen)
        elif dist.get_rank() == 0:
            try:
                pairs = EncodedPairs.load_or_encode(self.cfg.dpo.pairs, autoencoder, settings, frozen)
            except BaseException:
                broadcast_int(0, device)
                raise
            broadcast_int(1, device)
        else:
            if not broadcast_int(0, device):
                raise UserError(f"dpo.pairs = {self.cfg.dpo.pairs!r}: rank 0 could not encode the pairs (its error "
                                "says why)")
            pairs = EncodedPairs.load_or_encode(self.cfg.dpo.pairs, autoencoder, settings, frozen)
        if frozen is not None and hasattr(frozen, "release"):    # the cache holds their states: not needed to train
            frozen.release()
        tokenize = None if frozen is not None else text_encoder.tokenize     # frozen: the cached states instead
        loader = PairsLoader(pairs, tokenize, self.cfg.train.global_batch, self.cfg.train.micro_batch, rank, num_ranks,
                             self.cfg.run.seed)
        if not self.cfg.dpo.replay_weight:
            return loader
        from difftrain.sources import ConfiguredSource

        # as many replay samples a step as pairs, split over ranks and micro-batches as the pairs are
        replay = ConfiguredSource(self.cfg).build(autoencoder, text_encoder, rank, num_ranks, device,
                                                  self.cfg.train.micro_batch)
        return ReplayingPairs(loader, replay)


def check_replay(cfg: Config) -> None:
    """``dpo.replay_weight`` draws the base's kind of data from the config's data section: the shapes source only
    (the store's loader sets its own batches per bucket, which do not line up with the pairs')."""
    if cfg.dpo.replay_weight and cfg.data.source != "shapes":
        raise UserError(f"dpo.replay_weight = {cfg.dpo.replay_weight} with data.source = {cfg.data.source!r}: replay "
                        "draws from the shapes source only; set dpo.replay_weight = 0 (or data.source = 'shapes' "
                        "for a model of the shapes world)")
    if cfg.dpo.replay_weight and cfg.text.kind == "hf":
        raise UserError("dpo.replay_weight with text.kind = 'hf': DPO trains a frozen encoder's runs from the pairs' "
                        "cached states and releases the encoder, so replay samples could not be encoded; set "
                        "dpo.replay_weight = 0")


class ReplayingPairs:
    """The pairs loader with a replay source beside it: each pair micro-batch carries a micro-batch of the base's
    kind of training data (``Batch.replay``) of as many samples; both states are in the checkpoint, so a resumed
    run draws what an unbroken one does."""

    def __init__(self, pairs, replay):
        self.pairs, self.replay = pairs, replay

    def __iter__(self) -> "ReplayingPairs":
        return self

    def __next__(self) -> list:
        out, extra = next(self.pairs), next(self.replay)
        if len(out) != len(extra):
            raise RuntimeError(f"{len(out)} pair micro-batches against {len(extra)} replay micro-batches")
        for b, r in zip(out, extra):
            b.replay = r
        return out

    def validation_batches(self, ranks: int):
        return self.pairs.validation_batches(ranks)

    def state_dict(self) -> dict:
        return {**self.pairs.state_dict(), "replay": self.replay.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "replay" not in state:
            raise UserError("the checkpoint was trained without dpo.replay_weight: its replay draws cannot be "
                            "resumed; resume with dpo.replay_weight = 0 or start a new run")
        self.pairs.load_state_dict(state)
        self.replay.load_state_dict(state["replay"])


class PolicyWithoutAdapters:
    """The reference of a LoRA run: the policy's own ``Denoiser`` with its adapters disabled (the text encoder is
    frozen and shared)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def embed_text(self, b):
        return self.trainer.denoiser.embed_text(b)

    def __call__(self, *args, **kwargs):
        policy = self.trainer.denoiser
        with adapters_disabled(policy.dit):
            return policy(*args, **kwargs)


class DPOTrainer(Trainer):
    """The trainer with a DPO objective's reference: built from ``init_info`` (the starting checkpoint), handed
    to the objective, its digest in every checkpoint; plus validation and early stopping."""

    def __init__(self, cfg: Config, source: PairsSource, objective: DiffusionDPO, init_info: dict, run_dir=None,
                 env=None, resume: bool = True, allow_config_change: tuple[str, ...] = ()):
        self.init_info = init_info
        has_ema = bool(init_info.get("config", {}).get("train", {}).get("ema_decay", 0))
        self.init_weights = "ema" if cfg.dpo.use_ema and has_ema else "model"
        self.reference_digest = reference_digest(init_info, self.init_weights)
        self.val_best, self.val_bad_passes, self.val_history = None, 0, []
        super().__init__(cfg, source, objective, run_dir, env, resume, allow_config_change)

    # --- the policy and the reference -------------------------------------------------------------
    dpo_run = True

    @property
    def lora(self) -> bool:
        """A run with an adapter (``dpo.reference = 'lora'``): its reference is the policy without it."""
        return self.adapter is not None

    def _build_model(self, fresh: bool) -> nn.ModuleDict:
        model = super()._build_model(fresh)
        # the policy starts as the reference; a resume reads its own weights instead, the frozen base of an adapter
        # run apart (its checkpoints hold the adapters alone)
        if fresh or self.lora:
            self._load_init(model)
        for name in self.quantized:           # adapter.base_precision fp8 / nf4: the base read, now quantized
            self._quantize_one(name)
        if self.lora:
            self.reference = None
            self.objective.reference = PolicyWithoutAdapters(self)
        else:
            self.reference = self._build_reference()
            self.objective.reference = Denoiser(self.reference, self.reference_text, self.device, self.amp,
                                                padding=self.cfg.text.padding)
        return model

    def _load_init(self, model: nn.ModuleDict) -> None:
        params = {base_name(k): v.detach() for k, v in model.named_parameters() if not is_lora(k)}
        Checkpointer.load_tensors(self.init_info["path"], self.init_weights, params)

    def _adapter_base(self) -> dict:
        return {"source": self.init_info["path"], "digest": self.reference_digest, "weights": self.init_weights}

    def _build_reference(self) -> nn.ModuleDict:
        cfg = self.cfg
        params = dit_params(cfg, self.autoencoder.latent_channels * 4, self.text_encoder.dim,
                            self.text_encoder.pooled_dim)
        modules = {"dit": build_dit(params, device="meta")}
        if getattr(self.text_encoder, "trainable", False):      # a trained word encoder: the reference has its own
            modules["text"] = build_text_encoder(cfg, PairsSource(cfg, self.init_info).vocabulary(), self.device)
        ref = nn.ModuleDict(modules)
        units, _ = parallelize(ref, cfg, self.env, self.amp)
        for unit in units:          # no backward through it: the root need not stay gathered after its forward
            unit.set_reshard_after_forward(True)
        ref["dit"].to_empty(device=self.device)
        if self.device.type == "cuda" and self.amp == torch.bfloat16:
            ref.to(torch.bfloat16)
        Checkpointer.load_tensors(self.init_info["path"], self.init_weights,
                                  {k: v.detach() for k, v in ref.named_parameters()})
        ref.eval().requires_grad_(False)
        self.reference_text = ref["text"] if "text" in ref else self.text_encoder
        return ref

    # --- checkpoint metadata and resume ------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {"dpo": {"init": self.init_info["path"], "weights": self.init_weights,
                        "reference_digest": self.reference_digest, "val_best": self.val_best,
                        "val_bad_passes": self.val_bad_passes, "val_history": self.val_history}}

    def _resume(self, path: Path) -> None:
        info = Checkpointer.read_info(path)
        saved = info.get("dpo", {}).get("reference_digest")
        if saved != self.reference_digest:
            raise UserError(f"{path}: this DPO run's reference was {info.get('dpo', {}).get('init')!r} "
                            f"({str(saved)[:12]}...), the config's dpo.init is {self.init_info['path']!r} "
                            f"({self.reference_digest[:12]}...): resume with the reference it was trained against")
        super()._resume(path)
        d = info["dpo"]
        self.val_best, self.val_bad_passes = d.get("val_best"), int(d.get("val_bad_passes", 0))
        self.val_history = list(d.get("val_history", []))

    # --- validation and early stopping --------------------------------------------------------------
    def validate(self) -> float | None:
        """Implicit accuracy over the validation pairs (every rank's share; t and noise drawn with step 0, the
        same every pass)."""
        batches = self.loader.validation_batches(self.env.dp_size)
        if not batches:
            return None
        correct = total = 0.0
        self.model.eval()
        with torch.no_grad():
            for b, counts in batches:
                micro = self.objective.loss(self.denoiser, b, self.cfg.run.seed, 0, float(b.pairs))
                if counts:
                    correct += float(micro.stats[:, 0].sum())
                    total += float(len(micro.stats))
        self.model.train()
        correct, total = all_reduce_sum([correct, total], self.device)
        return correct / total if total else None

    def _stop_early(self) -> bool:
        d = self.cfg.dpo
        if not d.validation_every or self.step % d.validation_every:
            return False
        acc = self.validate()
        if acc is None:
            return False
        self.val_history.append([self.step, round(acc, 5)])
        improved = self.val_best is None or acc > self.val_best
        self.val_best = acc if improved else self.val_best
        self.val_bad_passes = 0 if improved else self.val_bad_passes + 1
        self.metrics.log(self.step, {"val_implicit_acc": round(acc, 5), "val_best": round(self.val_best, 5)})
        if d.patience and self.val_bad_passes >= d.patience:
            self.metrics.event("early_stop", self.step, val_implicit_acc=acc, best=self.val_best,
                               passes_without_gain=self.val_bad_passes)
            log.info("early stop at step %d: validation implicit accuracy %.4f, best %.4f, %d passes without gain",
                     self.step, acc, self.val_best, self.val_bad_passes)
            return True
        return False


def build_dpo_trainer(cfg: Config, run_dir=None, env=None, resume: bool = True,
                      allow_config_change: tuple[str, ...] = ()) -> DPOTrainer:
    """The trainer ``difftrain dpo`` runs: the pairs source and the DiffusionDPO objective the config describes
    (its reference attached once the trainer has built the policy)."""
    info = check_dpo_config(cfg)
    check_replay(cfg)
    objective = DiffusionDPO(FlowSpec.from_config(cfg.diffusion), cfg.dpo.beta, None, cfg.dpo.sft_weight,
                             cfg.dpo.replay_weight)
    return DPOTrainer(cfg, PairsSource(cfg, info), objective, info, run_dir, env, resume, allow_config_change)
