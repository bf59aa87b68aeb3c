"""The fine-tuner's first recipe on a base in diffusers' layout (``tests/tiny_flux.py``: a tiny FLUX pipeline saved by
diffusers at ``models/FLUX.1-dev``): the base is read whole from its folder (widths, text encoders at the pipeline
root with their tokenizers, the VAE), ``prepare`` that keeps nothing is an error naming the reasons (``--dry-run``
fails where the real run would), captions lose a byte-order mark, previews at the preset's own size and count make a
grid under Pillow's limits, after the step's checkpoint, and a preview failure never ends a run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.config import load_config
from difftrain.errors import UserError

from tiny_flux import save_tiny_flux_pipeline

pytestmark = pytest.mark.slow

MINE = 'extends = "flux-lora"\ndata.sources = [{path = "my-photos"}]\n'


def _photos(folder: Path, n: int, side: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    colours = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30), "yellow": (230, 220, 30)}
    for i in range(n):
        name = list(colours)[i % 4]
        img = np.full((side, side, 3), 128, np.uint8)
        x, y = rng.integers(0, side // 2, 2)
        img[y:y + side // 4, x:x + side // 4] = colours[name]
        Image.fromarray(img).save(folder / f"img{i:02d}.png")
        bom = "\ufeff" if i == 0 else ""             # one caption as a Windows editor writes it
        (folder / f"img{i:02d}.txt").write_text(f"{bom}a {name} square emoji", encoding="utf-8")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A user's folder: the base at models/FLUX.1-dev, 4 photos of 512 px, mine.toml as the docs write it."""
    root = tmp_path_factory.mktemp("recipe")
    save_tiny_flux_pipeline(root / "models" / "FLUX.1-dev")
    _photos(root / "my-photos", 4, 512)
    (root / "mine.toml").write_text(MINE)
    return root


@pytest.fixture
def inside(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    return workdir


def test_the_base_is_read_whole_from_its_folder(inside):
    cfg = load_config("mine.toml")
    m, t, ae = cfg.model, cfg.text, cfg.autoencoder
    config = json.loads(Path("models/FLUX.1-dev/transformer/config.json").read_text())
    assert (m.hidden, m.heads, m.double_blocks, m.single_blocks) == (32, 2, 1, 1)
    assert (m.text_dim, m.pooled_dim, m.in_channels) == (32, 32, 64)
    assert m.axes_dims_rope == config["axes_dims_rope"] and m.guidance_embed is True
    assert t.t5_path == t.clip_path == "models/FLUX.1-dev"          # the root, where the tokenizers are
    assert ae.path == "models/FLUX.1-dev/vae"
    # a user setting that contradicts the folder names both
    with pytest.raises(UserError, match=r"model.hidden = 3072 contradicts the base: .*config.json gives 32"):
        load_config("mine.toml", ["model.hidden=3072"])
    Path("wrong.toml").write_text(MINE + "model.guidance_embed = false\n")
    with pytest.raises(UserError, match=r"wrong.toml: model.guidance_embed = False contradicts the base"):
        load_config("wrong.toml")
    with pytest.raises(UserError, match=r"autoencoder.scaling = 0.5 contradicts the base: .*scaling_factor = 0.3611"):
        load_config("mine.toml", ["autoencoder.scaling=0.5"])
    # a setting that agrees, or the width left to the encoders (0), is fine
    assert load_config("mine.toml", ["model.hidden=32", "model.text_dim=0"]).model.text_dim == 32
    # a base without guidance embedding (schnell's layout) gives a model without it
    save_tiny_flux_pipeline(inside / "schnell" / "FLUX.1-schnell", guidance_embeds=False)
    cfg = load_config("mine.toml", ["model.init_from=schnell/FLUX.1-schnell/transformer"])
    assert cfg.model.guidance_embed is False and cfg.text.t5_path == "schnell/FLUX.1-schnell"


def test_prepare_that_keeps_nothing_is_an_error_and_dry_run_fails_the_same(inside, ray_local):
    """Photos under the preset's 512-pixel filter: both the dry run and the real one exit 2 naming the reason."""
    from difftrain.cli import main

    _photos(inside / "small", 3, 128)
    Path("small.toml").write_text('extends = "flux-lora"\ndata.sources = [{path = "small"}]\n'
                                  'data.store = "small-store"\n')
    for dry in (["--dry-run"], []):
        assert main(["prepare", "small.toml", "--no-progress", *dry]) == 2
    with pytest.raises(UserError, match=r"curation kept none of the 3 inputs \(size: min_side: 3\).*data.filters"):
        from difftrain.data.prepare.job import prepare
        prepare(load_config("small.toml"), dry_run=True, progress=False)
    assert not (inside / "small-store" / "curation.parquet").exists()


def test_the_recipe_prepares_and_trains_with_previews_at_the_presets_size(inside, ray_local, monkeypatch):
    """prepare, then train with the preset's own data.image_size (1024) and preview count (4), the sampler stubbed
    (zeros) so the test is fast: the grid is written under Pillow's limits and logged to TensorBoard, after the step's
    checkpoint; a caption's BOM is gone from the store."""
    from difftrain.cli import main
    from difftrain.data.store.tables import store_captions
    from difftrain.diffusion.pipeline import Pipeline
    from difftrain.images import GRID_MAX_PIXELS
    from difftrain.train import build_trainer

    assert main(["prepare", "mine.toml", "--no-progress"]) == 0
    captions = store_captions("flux-lora-store", 8)
    assert captions and not any(c.startswith("\ufeff") for c in captions)
    assert "a red square emoji" in captions

    cfg = load_config("mine.toml", ["train.steps=2", "train.sample_every=1", "train.checkpoint_every=1",
                                    "train.async_checkpoint=false"])
    assert cfg.data.image_size == 1024 and cfg.preview.count == 4
    sampled = []

    def stub(self, batch, steps=20, cfg_scale=4.0, shift=None, seed=0, rows=None, noise=None, on_step=None):
        F, H, W = batch.grid
        sampled.append((H, W, self.guidance))
        for i in range(2):
            on_step(i)
        return torch.zeros(len(batch), F, self.autoencoder.latent_channels, H, W)

    monkeypatch.setattr(Pipeline, "sample", stub)
    tr = build_trainer(cfg, inside / "runs" / "previews")
    saved_at_preview = []
    grid = tr.sample_grid

    def watched(path):
        saved_at_preview.append(tr.last_save.step if tr.last_save is not None else None)
        return grid(path)

    tr.sample_grid = watched
    tr.fit()
    tr.close()
    assert saved_at_preview == [1, 2]                  # each preview after its step's checkpoint
    png = inside / "runs" / "previews" / "samples" / "step_00000001.png"
    with Image.open(png) as im:
        w, h = im.size
    assert w * h <= GRID_MAX_PIXELS and h > 4 * 500      # four rows of about 1024 pixels, under the limit
    assert sampled and all((H * 8, W * 8, g) == (1024, 1024, 3.5) for H, W, g in sampled)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(inside / "runs" / "previews" / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert [e.step for e in acc.Images("previews")] == [1, 2]
    # the previews read their prompts' T5 and CLIP states from the store: the encoders were never built
    from difftrain.data.store.prompts import StoredPrompts
    from difftrain.models.hf_text import HFTextEncoder
    assert isinstance(tr.preview_text, StoredPrompts) and not tr.text_encoder.built
    events = (inside / "runs" / "previews" / "events.jsonl").read_text()
    assert '"encoders_built"' not in events
    # and those states are the encoders' own (stored in bf16), the empty caption's (guidance) too
    t = cfg.text
    enc = HFTextEncoder.from_paths(t.t5_path, t.clip_path, t.max_tokens, "fp32", device="cpu", padding=t.padding)
    prompts = [*tr.preview_prompts[:2], ""]
    want, got = enc(enc.tokenize(prompts)), tr.preview_text(tr.preview_text.tokenize(prompts))
    assert torch.equal(got.mask_BT, want.mask_BT[:, :got.mask_BT.shape[1]]), (got.mask_BT, want.mask_BT)
    keep = got.mask_BT[..., None]
    torch.testing.assert_close(got.txt_BTD * keep, (want.txt_BTD[:, :got.mask_BT.shape[1]] * keep).float(),
                               rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.pooled_BP, want.pooled_BP.float(), rtol=1e-2, atol=1e-2)


def test_a_store_fed_runs_own_preview_prompt_needs_the_encoders_and_is_refused_before_its_first_step(inside,
                                                                                                    ray_local):
    """A preview prompt the store does not hold, under preview.text = 'auto': refused at start, naming the key."""
    from difftrain.cli import main
    from difftrain.train import build_trainer

    if not Path("flux-lora-store", "store.json").is_file():       # (written by the recipe's test when run before)
        assert main(["prepare", "mine.toml", "--no-progress"]) == 0

    cfg = load_config("mine.toml", ["train.steps=1", "train.sample_every=1",
                                    'preview.prompts=[{prompt = "not in the store"}]'])
    tr = build_trainer(cfg, inside / "runs" / "own-prompt")
    try:
        with pytest.raises(UserError, match="preview.text = 'encoders'"):
            tr.fit()
        assert tr.step == 0
    finally:
        tr.close()


def test_previews_of_your_own_prompts_sizes_seeds_and_guidance(inside, monkeypatch):
    """preview.prompts: each preview its own size, seed and guidance; preview.count bounds them."""
    from difftrain.diffusion.pipeline import Pipeline
    from difftrain.evaluate import preview_rows

    seen = []

    def stub(self, batch, steps=20, cfg_scale=4.0, shift=None, seed=0, rows=None, noise=None, on_step=None):
        F, H, W = batch.grid
        seen.append((H * 8, W * 8, seed, self.guidance))
        return torch.zeros(len(batch), F, self.autoencoder.latent_channels, H, W)

    monkeypatch.setattr(Pipeline, "sample", stub)
    Path("own.toml").write_text(MINE + 'preview.count = 2\npreview.prompts = [{prompt = "a red cat", width = 512, '
                                       'height = 256, seed = 7, guidance = 2.0}, {prompt = "a blue dog"}, '
                                       '{prompt = "never drawn"}]\n')
    cfg = load_config("own.toml")
    from types import SimpleNamespace

    from difftrain.diffusion.flow import FlowSpec
    from difftrain.models import build_autoencoder

    ae = build_autoencoder("diffusers", path=cfg.autoencoder.path)
    words = SimpleNamespace(tokenize=lambda p: {"ids": torch.zeros(len(p), 4, dtype=torch.long)})
    pipe = Pipeline(None, words, ae, FlowSpec(), "cpu", guidance=3.5)
    rows = preview_rows(pipe, cfg, 4, ["ignored"])
    assert [p for _, p in rows] == ["a red cat", "a blue dog"]
    assert seen == [(256, 512, 7, 2.0), (1024, 1024, cfg.sample.seed, cfg.sample.guidance)]
    assert [img.shape[:2] for (imgs, _) in rows for img in imgs] == [(256, 512), (1024, 1024)]
    assert pipe.guidance == 3.5                               # put back
    for bad, where in ((" [{prompt = 'x', width = 100}]", "width = 100: expected 16..4096, a multiple of 16"),
                       (" [{prompt = 'x', colour = 1}]", "unknown key"), (" [{width = 64}]", "needs prompt")):
        Path("bad.toml").write_text(MINE + "preview.prompts =" + bad + "\n")
        with pytest.raises(UserError, match=where):
            load_config("bad.toml")


def test_a_failing_preview_is_logged_on_every_rank_and_the_run_goes_on(tiny_cfg, tmp_path, monkeypatch):
    import difftrain.images as images
    from difftrain.train import build_trainer

    def bomb(rows, path, **kw):
        raise Image.DecompressionBombError("Image size (236853056 pixels) exceeds limit")

    monkeypatch.setattr(images, "caption_grid", bomb)
    tr = build_trainer(tiny_cfg("train.steps=3", "train.sample_every=1", "train.checkpoint_every=0"),
                       tmp_path / "run")
    assert tr.fit()["steps"] == 3
    tr.close()
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["kind"] == "preview_failed"]
    assert [e["step"] for e in failed] == [1, 2, 3] and "DecompressionBombError" in failed[0]["reason"]


def test_a_stop_asked_for_while_a_preview_samples_abandons_it(tiny_cfg, tmp_path, monkeypatch):
    """A preemption (or Ctrl-C) arriving in the middle of a preview: the preview stops at its next sampler step and
    the run stops after the next step with its checkpoint, instead of finishing every preview first."""
    from difftrain.diffusion.pipeline import Pipeline
    from difftrain.train import build_trainer

    tr = build_trainer(tiny_cfg("train.steps=10", "train.sample_every=2", "train.checkpoint_every=0",
                                "sample.steps=50", f"sample.prompts={_prompts(tmp_path)}"), tmp_path / "run")
    calls = []
    real = Pipeline.sample

    def counting(self, batch, *a, on_step=None, **kw):
        def step(i):
            calls.append(i)
            if tr.step == 2 and i == 3:
                tr.preemption.requested = "SIGTERM"
            on_step(i)
        return real(self, batch, *a, on_step=step, **kw)

    monkeypatch.setattr(Pipeline, "sample", counting)
    summary = tr.fit()
    tr.close()
    assert summary["preempted"] and summary["steps"] == 3
    assert calls == [0, 1, 2, 3]                      # abandoned at its fourth sampler step of 50


def _prompts(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.txt"
    p.write_text("a large red circle in the top left\n")
    return p
