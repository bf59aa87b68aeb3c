"""Diffusion-DPO with frozen T5 + CLIP (``text.kind = 'hf'``): the pairs' prompts are encoded once, with the store's
text rule and cache key, and the encoders never run while training; the cached states give the DPO loss the
encoders give on the fly. Real tiny T5/CLIP models on disk (no mocks)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from difftrain.data.store.pairs import PAIR_COLUMNS, EncodedPairs

from test_encoders import tiny  # noqa: F401 - fixture: real tiny T5 + CLIP on disk

PROMPTS = ["a small red circle in the top left", "a big blue square", "a green triangle", "a red square at the top"]


def _hf(tiny, *extra):
    return ("text.kind=hf", f"text.t5_path={tiny['t5']}", f"text.clip_path={tiny['clip']}", "text.max_tokens=96",
            "train.ema_decay=0", "train.warmup_steps=0", "train.schedule=constant", *extra)


def _pairs_file(folder, per_prompt: int = 2):
    """``per_prompt`` pairs for each prompt, each pair two distinct plain-colour 32x32 candidates (a candidate
    is in two pairs: distinct images are encoded once)."""
    rows, rng = [], np.random.default_rng(0)
    for p, prompt in enumerate(PROMPTS):
        shades = rng.integers(0, 255, size=(per_prompt + 1, 3))
        for k, shade in enumerate(shades):
            Image.fromarray(np.broadcast_to(shade.astype(np.uint8), (32, 32, 3)).copy()).save(folder / f"{p}-{k}.png")
        for k in range(per_prompt):
            rows.append({"pair_id": len(rows), "prompt_id": f"p{p}", "prompt": prompt, "task": "t2i",
                         "winner": f"{p}-{k}", "loser": f"{p}-{k + 1}", "winner_image": f"{p}-{k}.png",
                         "loser_image": f"{p}-{k + 1}.png", "source_image": "", "winner_seed": k,
                         "loser_seed": k + 1, "agreement": 1.0, "raters": 1, "split": "train"})
    types = {"int64": pa.int64(), "string": pa.string(), "double": pa.float64()}
    schema = pa.schema([(c, types[t]) for c, t in PAIR_COLUMNS.items()])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / "pairs.parquet")
    return folder / "pairs.parquet"


def test_dpo_with_frozen_text_encoders_encodes_each_prompt_once_and_never_runs_them_while_training(
        tiny, tiny_cfg, tmp_path):
    from difftrain.data.store.tables import encoder_identity
    from difftrain.models.hf_text import HFTextEncoder
    from difftrain.train import build_trainer
    from difftrain.train import build_dpo_trainer

    build_trainer(tiny_cfg(*_hf(tiny, "train.steps=2", "train.checkpoint_every=2")), tmp_path / "base").fit()
    pairs = _pairs_file(tmp_path)
    cfg = tiny_cfg(*_hf(tiny, "train.steps=3", "train.checkpoint_every=0", "train.global_batch=4",
                        f"dpo.init={tmp_path / 'base'}", f"dpo.pairs={pairs}", "dpo.beta=200",
                        "data.latent_dtype=fp32", "train.precision=fp32"))
    tr = build_dpo_trainer(cfg, tmp_path / "dpo")
    assert not tr.text_encoder.built       # built to encode the pairs, then released: the cache feeds training

    # The cache: every distinct prompt's states at its true length under the rule, as the encoder gives them.
    enc = EncodedPairs.load_or_encode(pairs, None, {**encoder_identity(cfg), "latent_dtype": "fp32"})
    assert enc.text is not None and sorted(enc.prompts) == sorted(PROMPTS) and len(enc.text.offsets) == 5
    assert isinstance(enc.groups[0].latents, np.memmap) and enc.groups[0].latents.shape[0] == 12   # 4 x 3 images
    with torch.no_grad():
        fresh = tr.text_encoder(tr.text_encoder.tokenize(enc.prompts))
    for p in range(len(enc.prompts)):
        a, e = enc.text.offsets[p], enc.text.offsets[p + 1]
        assert e - a == int(fresh.mask_BT[p].sum())
        assert torch.allclose(torch.from_numpy(np.array(enc.text.txt[a:e]).view(np.float32)),
                              fresh.txt_BTD[p, :e - a], atol=1e-6)
        assert torch.allclose(torch.from_numpy(np.array(enc.text.pooled[p]).view(np.float32)),
                              fresh.pooled_BP[p], atol=1e-6)

    # A step's batch carries the states; its DPO loss equals the loss with the encoders run on the fly.
    state = tr.loader.state_dict()
    batch = next(tr.loader)[0]
    tr.loader.load_state_dict(state)
    assert batch.text is not None and batch.tokens == {} and batch.pairs == 4
    with torch.no_grad():
        for p in tr.model.parameters():         # a policy whose output depends on its text, unlike the reference
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    on_the_fly = type(batch)(**{**batch.__dict__, "text": None, "tokens": tr.text_encoder.tokenize(batch.prompts)})
    with torch.no_grad():
        cached = tr.objective.loss(tr.denoiser, batch, 0, 1, 4.0)
        direct = tr.objective.loss(tr.denoiser, on_the_fly, 0, 1, 4.0)
    assert abs(float(cached.loss) - float(direct.loss)) < 1e-5 and float(cached.loss) != pytest.approx(np.log(2))
    assert torch.allclose(cached.stats, direct.stats, atol=1e-4)

    # Training: T5 and CLIP never run (the policy's and the reference's text come from the cache).
    calls = []
    for module in (tr.text_encoder.encoder().t5, tr.text_encoder.encoder().clip):
        module.register_forward_hook(lambda *a: calls.append(1))
    summary = tr.fit()
    assert summary["steps"] == 3 and not calls

    # The cache key holds the text rule: another rule re-encodes ('padded': every prompt at max_tokens).
    padded = HFTextEncoder.from_paths(tiny["t5"], tiny["clip"], max_tokens=96, dtype="fp32", padding="padded")
    ident = encoder_identity(tiny_cfg(*_hf(tiny, "text.padding=padded")))
    again = EncodedPairs.load_or_encode(pairs, tr.autoencoder, {**ident, "latent_dtype": "fp32"}, padded)
    assert again.key != enc.key and set(np.diff(again.text.offsets).tolist()) == {96}
