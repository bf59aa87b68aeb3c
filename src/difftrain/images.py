"""Reading user images and writing PNGs and captioned sample grids."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont, UnidentifiedImageError

from difftrain.errors import UserError


def read_image(path: str | Path, size: int | None = None) -> np.ndarray:
    """An RGB uint8 (H, W, 3) array; resized (area-preserving centre crop to square) when ``size`` is given."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: image file not found")
    try:
        with Image.open(p) as im:
            im = im.convert("RGB")
            if size is not None and im.size != (size, size):
                side = min(im.size)
                left, top = (im.width - side) // 2, (im.height - side) // 2
                im = im.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.BICUBIC)
            return np.asarray(im, dtype=np.uint8).copy()
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{p}: cannot read as an image ({e.__class__.__name__}: {e})") from None


def write_png(img: np.ndarray, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(img, dtype=np.uint8)).save(p)
    return p


GRID_MAX_PIXELS = 32_000_000     # a preview grid stays well under Pillow's decompression-bomb limits (89M, 179M)


def caption_grid(rows: list[tuple[list[np.ndarray], str]], path: str | Path, scale: int = 0,
                 caption_width: int = 260) -> Path:
    """One row per prompt: its images side by side, the caption on the left. Small images are upscaled (nearest:
    ``scale``, by default up to 3x while a cell stays within 192 pixels); images of any size share a cell of the
    largest's size; a grid over ``GRID_MAX_PIXELS`` has its tiles scaled down to fit."""
    if not rows or not any(imgs for imgs, _ in rows):
        raise ValueError("caption_grid needs at least one row with an image")
    font = ImageFont.load_default()
    h = max(img.shape[0] for imgs, _ in rows for img in imgs)
    w = max(img.shape[1] for imgs, _ in rows for img in imgs)
    zoom = float(scale or max(1, min(3, 192 // max(h, w))))
    ncols = max(len(imgs) for imgs, _ in rows)
    pad = 4

    def size(z: float) -> tuple[int, int]:
        return (caption_width + ncols * (int(w * z) + pad) + pad, len(rows) * (max(int(h * z), 24) + pad) + pad)

    total = size(zoom)[0] * size(zoom)[1]
    if total > GRID_MAX_PIXELS:
        zoom *= (GRID_MAX_PIXELS / total) ** 0.5 * 0.99
    cell_h, cell_w = max(int(h * zoom), 24), int(w * zoom)
    canvas = Image.new("RGB", size(zoom), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for r, (imgs, caption) in enumerate(rows):
        y = pad + r * (cell_h + pad)
        lines = textwrap.wrap(caption or "(no prompt)", width=max(10, caption_width // 7))[: max(1, cell_h // 12)]
        draw.multiline_text((pad, y + 2), "\n".join(lines), fill=(0, 0, 0), font=font, spacing=2)
        for c, img in enumerate(imgs):
            th, tw = max(1, int(img.shape[0] * zoom)), max(1, int(img.shape[1] * zoom))
            resample = Image.Resampling.NEAREST if zoom >= 1 else Image.Resampling.BILINEAR
            tile = Image.fromarray(np.asarray(img, dtype=np.uint8)).resize((tw, th), resample)
            canvas.paste(tile, (caption_width + pad + c * (cell_w + pad), y))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(p)
    return p
