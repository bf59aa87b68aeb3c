"""``difftrain dpo``: Diffusion-DPO on the trainer: the pairs source and the ``DPO`` objective (``DiffusionDPO`` with the
hooks a DPO run adds, ``contract.RunHooks``); the entry point hands both to the trainer (``train.build_dpo_trainer``).

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

import logging
from pathlib import Path

import torch

from difftrain.config import Config, to_dict
from difftrain.diffusion.flow import FlowSpec
from difftrain.errors import UserError
from difftrain.models.lora import adapters_disabled
from difftrain.parallel.dist import all_reduce_sum
from difftrain.train.build import Weights, build_model
from difftrain.train.checkpoint import Checkpointer
from difftrain.train.contract import Denoiser, RunView
from difftrain.train.objectives import DiffusionDPO
from difftrain.train.verification import reference_digest

log = logging.getLogger("difftrain.train")

# Sections a DPO run takes from its starting checkpoint unchanged: what the weights mean.
SAME_AS_INIT = ("model", "text", "autoencoder", "diffusion")


def check_dpo_config(cfg: Config) -> dict:
    """The starting checkpoint's metadata, after the checks the verb needs: ``dpo.init`` and ``dpo.pairs`` set, the
    architecture the checkpoint's (what the config alone decides -- no context parallelism, replay's data -- is
    refused when it is read: ``config.refusals``)."""
    d = cfg.dpo
    if not d.init:
        raise UserError("dpo.init is empty: set it to the checkpoint DPO starts from (a run directory or a "
                        "checkpoint directory)")
    if not d.pairs:
        raise UserError("dpo.pairs is empty: set it to the pairs file 'difftrain pairs' wrote")
    info = Checkpointer.read_info(d.init)
    theirs, ours = info.get("config", {}), to_dict(cfg)
    diff = [f"{sec}.{k}: checkpoint {theirs.get(sec, {}).get(k)!r}, config {v!r}"
            for sec in SAME_AS_INIT for k, v in ours[sec].items() if theirs.get(sec, {}).get(k, v) != v]
    if diff:
        raise UserError(f"dpo.init = {d.init!r} is another architecture than this config: {'; '.join(diff[:6])}"
                        f"{' ...' if len(diff) > 6 else ''}. Copy those sections from the checkpoint's "
                        f"config ({info['path']}/trainer.json)")
    return info


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

    def __init__(self, policy: Denoiser):
        self.policy = policy

    def embed_text(self, b):
        return self.policy.embed_text(b)

    def __call__(self, *args, **kwargs):
        with adapters_disabled(self.policy.dit):
            return self.policy(*args, **kwargs)


class DPO(DiffusionDPO):
    """The DPO run's objective: ``DiffusionDPO`` plus what the run needs around it (``contract.RunHooks``): the policy
    starts from ``init_info`` (the starting checkpoint; its EMA weights with ``dpo.use_ema``); the reference, built
    once the policy is (a frozen copy of the starting weights, or the policy with its adapters disabled), is handed to
    the loss; its digest is in every checkpoint and checked on resume; validation and early stopping."""

    starts_from_checkpoint = True

    def __init__(self, cfg: Config, init_info: dict):
        super().__init__(FlowSpec.from_config(cfg.diffusion), cfg.dpo.beta, None, cfg.dpo.sft_weight,
                         cfg.dpo.replay_weight)
        self.cfg, self.init_info = cfg, init_info
        has_ema = bool(init_info.get("config", {}).get("train", {}).get("ema_decay", 0))
        self.init_weights = "ema" if cfg.dpo.use_ema and has_ema else "model"
        self.reference_digest = reference_digest(init_info, self.init_weights)
        self.val_best, self.val_bad_passes, self.val_history = None, 0, []
        self.reference_model = None

    # --- the policy and the reference -------------------------------------------------------------
    def adapter_spec(self, cfg: Config):
        from difftrain.train.adapters import check_adapter_config
        return check_adapter_config(cfg, dpo=True)

    def start_weights(self, cfg: Config) -> Weights:
        return Weights.checkpoint(self.init_info["path"], self.init_weights)

    def adapter_base(self, cfg: Config, run_dir, is_main: bool) -> dict:
        return {"source": self.init_info["path"], "digest": self.reference_digest, "weights": self.init_weights}

    def attach(self, run: RunView) -> None:
        if run.adapter is not None:          # dpo.reference = 'lora': the policy without its adapters
            self.reference = PolicyWithoutAdapters(run.denoiser)
            return
        cfg = run.cfg
        text = run.text_encoder
        if getattr(text, "trainable", False):      # a trained word encoder: the reference has its own
            from difftrain.models import build_text_encoder
            text = build_text_encoder(cfg, PairsSource(cfg, self.init_info).vocabulary(), run.device)
        built = build_model(cfg, "reference", device=run.device, text_encoder=text, autoencoder=run.autoencoder,
                            weights=Weights.checkpoint(self.init_info["path"], self.init_weights), env=run.env,
                            amp=run.amp)
        self.reference_model = built.model
        self.reference = Denoiser(built.model, built.model["text"] if "text" in built.model else text, run.device,
                                  run.amp, padding=cfg.text.padding)

    # --- checkpoint metadata and resume ------------------------------------------------------------
    def extra_state(self) -> dict:
        return {"dpo": {"init": self.init_info["path"], "weights": self.init_weights,
                        "reference_digest": self.reference_digest, "val_best": self.val_best,
                        "val_bad_passes": self.val_bad_passes, "val_history": self.val_history}}

    def check_resume(self, info: dict, path: Path) -> None:
        saved = info.get("dpo", {}).get("reference_digest")
        if saved != self.reference_digest:
            raise UserError(f"{path}: this DPO run's reference was {info.get('dpo', {}).get('init')!r} "
                            f"({str(saved)[:12]}...), the config's dpo.init is {self.init_info['path']!r} "
                            f"({self.reference_digest[:12]}...): resume with the reference it was trained against")

    def load_state(self, info: dict) -> None:
        d = info["dpo"]
        self.val_best, self.val_bad_passes = d.get("val_best"), int(d.get("val_bad_passes", 0))
        self.val_history = list(d.get("val_history", []))

    # --- validation and early stopping --------------------------------------------------------------
    def validate(self, run: RunView) -> float | None:
        """Implicit accuracy over the validation pairs (every rank's share; t and noise drawn with step 0, the
        same every pass)."""
        batches = run.loader.validation_batches(run.env.dp_size)
        if not batches:
            return None
        correct = total = 0.0
        run.model.eval()
        with torch.no_grad():
            for b, counts in batches:
                micro = self.loss(run.denoiser, b, run.cfg.run.seed, 0, float(b.pairs))
                if counts:
                    correct += float(micro.stats[:, 0].sum())
                    total += float(len(micro.stats))
        run.model.train()
        correct, total = all_reduce_sum([correct, total], run.device)
        return correct / total if total else None

    def stop_early(self, run: RunView, step: int) -> bool:
        d = run.cfg.dpo
        if not d.validation_every or step % d.validation_every:
            return False
        acc = self.validate(run)
        if acc is None:
            return False
        self.val_history.append([step, round(acc, 5)])
        improved = self.val_best is None or acc > self.val_best
        self.val_best = acc if improved else self.val_best
        self.val_bad_passes = 0 if improved else self.val_bad_passes + 1
        run.metrics.log(step, {"val_implicit_acc": round(acc, 5), "val_best": round(self.val_best, 5)})
        if d.patience and self.val_bad_passes >= d.patience:
            run.metrics.event("early_stop", step, val_implicit_acc=acc, best=self.val_best,
                              passes_without_gain=self.val_bad_passes)
            log.info("early stop at step %d: validation implicit accuracy %.4f, best %.4f, %d passes without gain",
                     step, acc, self.val_best, self.val_bad_passes)
            return True
        return False


def dpo_run(cfg: Config) -> tuple[PairsSource, DPO]:
    """The data source and objective ``difftrain dpo`` trains with (the trainer is the entry point's: ``train``)."""
    info = check_dpo_config(cfg)
    return PairsSource(cfg, info), DPO(cfg, info)
