"""Data: the shapes world and its evaluator, the raw-data path (ingest, curation, prepare, the latent
store) and the data sources training reads.

A *data source* is an iterator that yields, per optimizer step, this data rank's micro-batches of the
step's global batch (a list of ``Batch``) and has ``state_dict`` / ``load_state_dict`` (positions of
batches consumed by the optimizer). ``data.source`` picks one: ``shapes`` (``ShapesLoader``, the
procedural world rendered on the fly) or ``store`` (``StoreLoader``, the latent store).
"""

from __future__ import annotations

from difftrain.data.shapes import ShapesWorld


def world_from_config(data_cfg, seed: int) -> ShapesWorld:
    """The shapes world a config describes (``[data]``), for a given seed (training or evaluation)."""
    return ShapesWorld(seed, data_cfg.image_size, data_cfg.frames, tuple(data_cfg.background), data_cfg.motion)


def vocabulary_for(cfg) -> list[str]:
    """The word vocabulary of the data a config trains on (for ``text.kind = 'words'``): the shapes world's,
    or the one ``difftrain prepare`` recorded from the store's captions."""
    if cfg.data.source == "store":
        from difftrain.data.store import read_manifest
        from difftrain.errors import UserError
        manifest = read_manifest(cfg.data.store)
        if manifest is None:
            raise UserError(f"data.store = {cfg.data.store!r}: no store there; run 'difftrain prepare CONFIG' first")
        return list(manifest.get("vocabulary", []))
    from difftrain.data.shapes import vocabulary
    return vocabulary()


def build_source(cfg, autoencoder, text_encoder, rank: int = 0, num_ranks: int = 1, device="cpu",
                 micro_batch: int = 0):
    """The data source ``data.source`` names, serving data rank ``rank`` of ``num_ranks``."""
    d = cfg.data
    if d.source == "store":
        from difftrain.data.store_loader import StoreLoader
        tokenize = None if cfg.text.kind == "hf" else text_encoder.tokenize   # frozen encoders: embeddings stored
        return StoreLoader(cfg, tokenize, rank, num_ranks, device)
    from difftrain.data.shapes_loader import ShapesLoader
    return ShapesLoader(world_from_config(d, cfg.run.seed), autoencoder, text_encoder.tokenize, cfg.train.global_batch,
                        {"t2i": d.t2i_weight, "edit": d.edit_weight, "keyframes": d.keyframe_weight}, d.world_size,
                        d.caption_dropout, d.keyframe_cond_prob, cfg.run.seed, micro_batch=micro_batch, rank=rank,
                        num_ranks=num_ranks)


__all__ = ["ShapesWorld", "world_from_config", "vocabulary_for", "build_source"]
