"""The data source a config names (``data.source``): the shapes world rendered on the fly, or the latent
store. It sits above both ``difftrain.shapes`` and ``difftrain.data``, which know nothing of each other; the
trainer is handed a ``ConfiguredSource`` and never imports either.

A data source is an iterator yielding, per optimizer step, this data rank's micro-batches of the step's
global batch (a list of ``Batch``), with ``state_dict`` / ``load_state_dict`` (batches consumed by the
optimizer) and optionally ``close`` and ``errors`` (damaged rows skipped so far).
"""

from __future__ import annotations

from dataclasses import dataclass

from difftrain.errors import UserError


@dataclass(frozen=True)
class ConfiguredSource:
    """What ``data.source`` names, built on demand: the trainer first asks it for the word vocabulary (the text
    encoder is built from it), then for the source serving its data rank."""

    cfg: object

    @property
    def per_bucket_batches(self) -> bool:
        """The store sets global and micro-batches per bucket (its loader checks them); the shapes source
        takes ``train.global_batch`` and ``train.micro_batch``."""
        return self.cfg.data.source == "store"

    @property
    def batch_kinds(self) -> tuple[str, ...]:
        """What its batches hold: samples (a pair objective needs a source of preference pairs)."""
        return ("samples",)

    def vocabulary(self) -> list[str]:
        """The word vocabulary of the data (for ``text.kind = 'words'``): the shapes world's, or the one
        ``difftrain prepare`` recorded from the store's captions."""
        if self.cfg.data.source == "store":
            from difftrain.data.store.tables import read_manifest
            manifest = read_manifest(self.cfg.data.store)
            if manifest is None:
                raise UserError(f"data.store = {self.cfg.data.store!r}: no store there; run 'difftrain prepare "
                                "CONFIG' first")
            return list(manifest.get("vocabulary", []))
        from difftrain.shapes import vocabulary
        return vocabulary()

    def preview_prompts(self, n: int) -> list[str] | None:
        """Prompts for the training previews: ``sample.prompts`` (a file, one a line), else the run's own data's:
        None for the shapes source (its previews are the world's tasks), the first ``n`` captions of the
        store's text-to-image tables for the store."""
        path = self.cfg.sample.prompts
        if path:
            try:
                lines = [ln.strip() for ln in open(path, encoding="utf-8").read().splitlines()]
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"sample.prompts = {path!r}: cannot read it ({e})") from None
            prompts = [ln for ln in lines if ln]
            if not prompts:
                raise UserError(f"sample.prompts = {path!r}: no prompts in it (one a line expected)")
            return prompts[:n]
        if self.cfg.data.source != "store":
            return None
        from difftrain.data.store.tables import store_captions
        prompts = store_captions(self.cfg.data.store, n)
        if not prompts:
            raise UserError(f"data.store = {self.cfg.data.store!r}: no captions in its text-to-image tables to "
                            "preview with; set sample.prompts to a file of prompts, or train.sample_every = 0")
        return prompts

    def preview_text(self, prompts: list[str], device):
        """What previews encode ``prompts`` with instead of the text encoders, or None (they encode): for a store-fed
        run with frozen encoders under ``preview.text = 'auto'``, the states the store holds (``StoredPrompts``),
        refused at start, naming the prompt, when one is not among them."""
        cfg = self.cfg
        if cfg.data.source != "store" or cfg.text.kind != "hf" or cfg.preview.text != "auto":
            return None
        from difftrain.data.store.prompts import StoredPrompts, stored_states

        states = stored_states(cfg.data.store, prompts, cfg.data.latent_dtype)
        stored = StoredPrompts(states, cfg.text.padding, cfg.text.max_tokens, device)
        stored.tokenize(prompts)                 # a prompt the store does not hold: refused now, not mid-run
        return stored

    def build(self, autoencoder, text_encoder, rank: int = 0, num_ranks: int = 1, device="cpu",
              micro_batch: int = 0):
        """The source serving data rank ``rank`` of ``num_ranks``."""
        cfg, d = self.cfg, self.cfg.data
        if d.source == "store":
            from difftrain.data.store.loader import StoreLoader
            tokenize = None if cfg.text.kind == "hf" else text_encoder.tokenize   # frozen encoders: stored states
            return StoreLoader(cfg, tokenize, rank, num_ranks, device)
        from difftrain.shapes import world_from_config
        from difftrain.shapes.loader import ShapesLoader
        return ShapesLoader(world_from_config(d, cfg.run.seed, training=True), autoencoder, text_encoder.tokenize,
                            cfg.train.global_batch,
                            {"t2i": d.t2i_weight, "edit": d.edit_weight, "keyframes": d.keyframe_weight},
                            d.world_size, d.caption_dropout, d.keyframe_cond_prob, cfg.run.seed,
                            micro_batch=micro_batch, rank=rank, num_ranks=num_ranks, stages=self.shapes_stages(),
                            edit_changed_weight=d.edit_changed_weight)

    def shapes_stages(self):
        """The curriculum the on-the-fly shapes source follows (``data.stages``; None without one): each step
        renders one bucket of the stage in force. It takes ``train.global_batch`` and ``train.micro_batch`` and
        the task weights, so a stage's per-bucket global batch must equal the former and a source mixture (store
        source names) has nothing to weigh."""
        cfg = self.cfg
        if not cfg.data.stages:
            return None
        from difftrain.config.refusals import check_shapes_stages
        from difftrain.data.curriculum import parse_stages
        check_shapes_stages(cfg, "config")          # the schema's rule (a config made in code is checked here too)
        return parse_stages(cfg)


def vocabulary_for(cfg) -> list[str]:
    """The word vocabulary of the data a config trains on."""
    return ConfiguredSource(cfg).vocabulary()
