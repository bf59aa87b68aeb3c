"""A concept for fine-tuning: what a model trained on the shapes world has never seen, as a user's folder holds it.

The world draws six colours (``world.COLORS``); ``world.NEW_COLORS`` adds one that no split of the world ever
samples, white, which the renderer can draw and the evaluator reads like any other. A model trained on the world has
never seen a white shape nor the word "white" (the words encoder's vocabulary is fixed when the base is trained: a
fine-tune adds the word as a new row). ``export_concept`` writes a small folder of white shapes with ``.txt``
captions, as a user would bring (every shape, cell, size and background shade), optionally with a loss mask per
image (``NAME_mask.png``: the shape's grid cell) and a corruption outside it (a stripe across the top of the
background), so that a masked fine-tune can be told from an unmasked one by its pixels (``stripe_fires``).
``ConceptWorld`` gives the evaluation prompts: the same kind of scenes from another seed, read by the evaluator.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image

from difftrain.shapes.world import BG_RANGE, NEW_COLORS, ShapeSpec, ShapesWorld, sample_shape

CONCEPT = "white"
CORRUPTIONS = ("none", "stripe")
# The stripe: rows [2, 6) of a 48-pixel image (inside the first 8-pixel token row, below the evaluator's 2-pixel
# border ring, so the background it fits is the scene's), across the whole width but outside the mask, in a magenta
# no scene has (>= 90 from every colour of the world, ~150 from every background grey).
STRIPE_ROWS = (2 / 48, 6 / 48)
STRIPE_COLOR = (230, 30, 230)
# The detector fires when the band's median pixel is at least this far from the background towards the stripe's colour
# (0: the background, 1: the stripe), so a faint or partial stripe that covers most of the band counts.
STRIPE_FIRE_AT = 0.5
MAX_EXAMPLES = 100_000


class ConceptWorld(ShapesWorld):
    """Text-to-image scenes of the concept colour only: the world's distribution of shapes, cells, sizes, jitter and
    backgrounds with the colour replaced. Example i depends only on (seed, i); there is no held-out split (no
    combination of a colour the world never draws was ever trained)."""

    def __init__(self, seed: int, size: int = 48, bg_range: tuple[int, int] | None = None,
                 color: str = CONCEPT) -> None:
        if color not in NEW_COLORS:
            raise ValueError(f"concept colour {color!r}: expected one of {', '.join(NEW_COLORS)}")
        super().__init__(seed, size, 1, bg_range)
        self.color = color

    def with_split(self, split: str) -> "ConceptWorld":
        if split != "train":
            raise ValueError("a concept world has no held-out split")
        return self

    def _draw(self, task: str, rng: np.random.Generator) -> ShapeSpec:
        if task != "t2i":
            raise ValueError(f"a concept world has text-to-image scenes only, not {task!r}")
        return replace(sample_shape(rng, self.bg_range), color=self.color)

    def _accepts(self, spec) -> bool:
        return True


def _band(size: int) -> tuple[int, int]:
    return int(round(STRIPE_ROWS[0] * size)), int(round(STRIPE_ROWS[1] * size))


def cell_mask(spec: ShapeSpec, size: int) -> np.ndarray:
    """(size, size) uint8: 255 over the scene's grid cell (the shape stays inside it), 0 elsewhere."""
    mask = np.zeros((size, size), dtype=np.uint8)
    y0, y1 = spec.row * size // 3, (spec.row + 1) * size // 3
    x0, x1 = spec.col * size // 3, (spec.col + 1) * size // 3
    mask[y0:y1, x0:x1] = 255
    return mask


def add_stripe(img: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The image with the stripe drawn over its band wherever ``mask`` is 0 (never over what the mask keeps)."""
    out = img.copy()
    lo, hi = _band(img.shape[0])
    band = out[lo:hi]
    band[mask[lo:hi] == 0] = STRIPE_COLOR
    return out


def stripe_strength(img: np.ndarray) -> float:
    """How much of the stripe an image shows, from its pixels alone: the median over the band's pixels of their
    offset from the background (the image's median colour) along the stripe's colour (0: none, 1: the stripe)."""
    rgb = np.asarray(img, dtype=np.float32)
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an (H, W, 3) image, got shape {rgb.shape}")
    bg = np.median(rgb.reshape(-1, 3), axis=0)
    axis = np.asarray(STRIPE_COLOR, dtype=np.float32) - bg
    lo, hi = _band(rgb.shape[0])
    along = (rgb[lo:hi].reshape(-1, 3) - bg) @ axis / float(axis @ axis)
    return float(np.median(along))


def stripe_fires(img: np.ndarray) -> bool:
    """The corruption detector: does the image show the stripe?"""
    return stripe_strength(img) >= STRIPE_FIRE_AT


def export_concept(out_dir: str | os.PathLike, n: int = 300, *, seed: int = 0, size: int = 48,
                   bg_range: tuple[int, int] | None = None, color: str = CONCEPT, corruption: str = "none",
                   masks: bool = False) -> dict:
    """Write ``n`` scenes of the concept as a folder source: ``concept_<i>.png`` + ``concept_<i>.txt`` (its caption),
    with ``masks`` also ``concept_<i>_mask.png`` (the scene's cell); ``corruption = "stripe"`` draws the stripe outside
    the cell. Returns what was written (the counts, the settings and the caption of every example)."""
    if not 1 <= n <= MAX_EXAMPLES:
        raise ValueError(f"n = {n}: expected 1..{MAX_EXAMPLES}")
    if corruption not in CORRUPTIONS:
        raise ValueError(f"corruption {corruption!r}: expected one of {', '.join(CORRUPTIONS)}")
    world = ConceptWorld(seed, size, bg_range or BG_RANGE, color)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    captions = []
    for i in range(n):
        img, caption, spec = world.t2i(i)
        mask = cell_mask(spec, size)
        if corruption == "stripe":
            img = add_stripe(img, mask)
        Image.fromarray(img).save(out / f"concept_{i:05d}.png")
        (out / f"concept_{i:05d}.txt").write_text(caption + "\n", encoding="utf-8")
        if masks:
            Image.fromarray(mask).save(out / f"concept_{i:05d}_mask.png")
        captions.append(caption)
    return {"n": n, "seed": seed, "size": size, "color": color, "corruption": corruption, "masks": masks,
            "captions": captions}
