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


def caption_grid(rows: list[tuple[list[np.ndarray], str]], path: str | Path, scale: int = 3,
                 caption_width: int = 260) -> Path:
    """One row per prompt: its images side by side (upscaled ``scale`` x, nearest), the caption on the left."""
    if not rows:
        raise ValueError("caption_grid needs at least one row")
    font = ImageFont.load_default()
    h, w = rows[0][0][0].shape[:2]
    cell_h, cell_w = h * scale, w * scale
    ncols = max(len(imgs) for imgs, _ in rows)
    pad = 4
    canvas = Image.new("RGB", (caption_width + ncols * (cell_w + pad) + pad, len(rows) * (cell_h + pad) + pad),
                       (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for r, (imgs, caption) in enumerate(rows):
        y = pad + r * (cell_h + pad)
        lines = textwrap.wrap(caption or "(no prompt)", width=max(10, caption_width // 7))[: max(1, cell_h // 12)]
        draw.multiline_text((pad, y + 2), "\n".join(lines), fill=(0, 0, 0), font=font, spacing=2)
        for c, img in enumerate(imgs):
            tile = Image.fromarray(np.asarray(img, dtype=np.uint8)).resize((cell_w, cell_h), Image.Resampling.NEAREST)
            canvas.paste(tile, (caption_width + pad + c * (cell_w + pad), y))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(p)
    return p
