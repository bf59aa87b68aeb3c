"""Read shapes-world images back, so generated samples can be scored against their prompts.

The reader has to cope with what a small diffusion model produces: noisy or slightly
tinted backgrounds, shifted colours, blobby or blurred edges and stray speckles. The
pipeline is built so that each step is robust to exactly those defects:

1. Background = a plane per channel fitted robustly to the border ring (the shape
   covers at most a small part of it; gradients in generated backgrounds are
   absorbed by the plane). Noise level = MAD of the ring's residuals.
2. Foreground evidence = distance to the background, box-filtered 3x3 (averages noise
   away, squashes single-pixel speckles to 1/9) minus the ring's typical distance
   (noise makes distances positive on average), thresholded at half its peak.
3. Keep the connected component with the most evidence, so speckles and secondary
   blobs are ignored.
4. Colour = nearest palette colour to the median colour of the component's core.
5. Soft coverage ("alpha") = projection of each pixel onto the background->colour
   line. Unlike a distance it is unbiased under zero-mean noise, so sums over it
   (area, centroid) stay accurate on noisy images and keep anti-aliasing/blur info.
6. Shape = best least-squares match between alpha and an area- and centroid-matched
   template of each shape, drawn by the generator's own rasteriser. This matched
   filter uses every pixel, which is what makes tiny (5 px) shapes separable where
   bounding-box fill ratios are too quantised.
7. Size = extent of the fitted template vs. the cell; position = cell of its centre.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from difftrain.data.shapes import (
    COLORS, SHAPE_FILL, SHAPES, SIZE_EXTENT, EditSpec, MotionSpec, ShapeSpec, coverage, parse_caption,
)

_PALETTE_NAMES = tuple(COLORS)
_PALETTE = np.asarray([COLORS[c] for c in _PALETTE_NAMES], dtype=np.float32)
# Small/large decision at the geometric mean of the two extents (0.6 of a cell).
_SIZE_SPLIT = float(np.sqrt(SIZE_EXTENT["small"] * SIZE_EXTENT["large"]))
_ONES3 = np.ones(3, dtype=np.float32)
_MIN_CONTRAST = 25.0  # a shape must differ from the background by this much (0..255 RGB distance)
_NOISE_CONTRAST = 2.5  # ... and by this many noise standard deviations
# Smallest shape (small triangle) covers 0.5 * 0.45^2 = 0.10 of a cell; accept down to 40% of that.
_MIN_AREA = 0.4 * SHAPE_FILL["triangle"] * SIZE_EXTENT["small"] ** 2
_TEMPLATE_SS = 4  # template supersampling, as in rendering (2 was measurably worse on 5 px shapes)
_BLUR_LEVELS = 3  # templates are tried sharp, blurred once and blurred twice
_MASK_GROW = 2  # pixels the component mask grows by to catch anti-aliased or blurred edges


@dataclass
class Reading:
    """What the reader saw. Attributes are None when ``found`` is False."""

    found: bool
    color: str | None = None
    shape: str | None = None
    row: int | None = None
    col: int | None = None
    size: str | None = None
    # (x, y) in pixels of the fitted shape's bounding-box centre (for a triangle this is
    # extent/6 above its area centroid); the cell is read from this point
    centroid: tuple[float, float] | None = None
    area: float = 0.0  # soft area in pixels
    confidence: float = 0.0  # 0..1: contrast over noise times template fit quality

    def attributes(self) -> dict[str, Any]:
        return {"shape": self.shape, "color": self.color, "size": self.size, "row": self.row, "col": self.col}


def _to_float_rgb(img: np.ndarray) -> np.ndarray:
    """uint8 HxWx3, float in [0, 1], or greyscale HxW -> float32 HxWx3 in 0..255."""
    arr = np.asarray(img)
    if arr.ndim == 2:
        arr = np.repeat(arr[:, :, None], 3, axis=2)
    if arr.ndim != 3 or arr.shape[2] not in (3, 4) or min(arr.shape[:2]) < 8:
        raise ValueError(f"expected an HxWx3 image of at least 8x8 pixels, got shape {arr.shape}")
    arr = arr[:, :, :3]
    if np.issubdtype(arr.dtype, np.floating):
        return np.clip(np.nan_to_num(arr.astype(np.float32)), 0.0, 1.0) * 255.0
    return arr.astype(np.float32)


def _sum3(a: np.ndarray, axis: int) -> np.ndarray:
    """Sum of each element and its two neighbours along ``axis`` (0 or 1), edges replicated."""
    out = a.copy()
    if axis == 0:
        out[1:] += a[:-1]
        out[:-1] += a[1:]
        out[0] += a[0]
        out[-1] += a[-1]
    else:
        out[:, 1:] += a[:, :-1]
        out[:, :-1] += a[:, 1:]
        out[:, 0] += a[:, 0]
        out[:, -1] += a[:, -1]
    return out


def _box3(a: np.ndarray) -> np.ndarray:
    """3x3 mean filter with edge replication (no scipy; slicing beats np.pad on tiny images)."""
    return _sum3(_sum3(a, 0), 1) / 9.0


def _binomial_blur(a: np.ndarray) -> np.ndarray:
    """Separable [1, 2, 1] / 4 blur over the last two axes, zero padded (templates are 0 at the edge)."""
    v = 0.5 * a
    v[..., 1:, :] += 0.25 * a[..., :-1, :]
    v[..., :-1, :] += 0.25 * a[..., 1:, :]
    out = 0.5 * v
    out[..., 1:] += 0.25 * v[..., :-1]
    out[..., :-1] += 0.25 * v[..., 1:]
    return out


def _dilate(mask: np.ndarray, steps: int) -> np.ndarray:
    """Binary dilation with a 3x3 square, ``steps`` times (slicing, no scipy)."""
    for _ in range(steps):
        grown = mask.copy()
        grown[1:] |= mask[:-1]
        grown[:-1] |= mask[1:]
        mask = grown.copy()
        mask[:, 1:] |= grown[:, :-1]
        mask[:, :-1] |= grown[:, 1:]
    return mask


@dataclass(frozen=True)
class _RingModel:
    """Cached geometry for fitting a background plane to the border ring of an h x w image."""

    ring: np.ndarray  # (h, w) bool: the outer ring, 1 px wide per 24 px of side
    design: np.ndarray  # (n_ring, 3): [1, x, y] per ring pixel, x and y scaled to [-1, 1]
    pinv: np.ndarray  # (3, n_ring) least-squares solver for the design
    grid: np.ndarray  # (h, w, 3): [1, x, y] for every pixel, to evaluate the plane


@lru_cache(maxsize=16)
def _ring_model(h: int, w: int) -> _RingModel:
    ring_w = max(1, min(h, w) // 24)
    ring = np.ones((h, w), dtype=bool)
    ring[ring_w:h - ring_w, ring_w:w - ring_w] = False
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    grid = np.stack([np.ones_like(xx), 2 * xx / (w - 1) - 1, 2 * yy / (h - 1) - 1], axis=-1)
    design = grid[ring]
    return _RingModel(ring, design, np.linalg.pinv(design).astype(np.float32), grid)


def _background(rgb: np.ndarray) -> tuple[np.ndarray, float, np.ndarray]:
    """Per-pixel background (h, w, 3), its noise sigma, and the ring mask.

    The background is a plane per channel fitted to the border ring, so gentle
    gradients or vignetting in generated images do not read as foreground. The fit is
    done twice: the second time without outliers (a shape touching the ring, speckles).
    """
    model = _ring_model(*rgb.shape[:2])
    ring_px = rgb[model.ring]
    coef = model.pinv @ ring_px  # (3 plane terms, 3 channels)
    resid = np.abs(ring_px - model.design @ coef)
    scale = np.maximum(1.4826 * _median(resid), 2.0)
    inliers = (resid <= 3.0 * scale).all(axis=1)
    if not inliers.all() and inliers.sum() >= 8:  # refit on inliers (3x3 normal equations)
        x = model.design[inliers]
        coef = np.linalg.solve(x.T @ x, x.T @ ring_px[inliers]).astype(np.float32)
        resid = np.abs(ring_px - model.design @ coef)
    noise = float(np.mean(1.4826 * _median(resid)))
    return model.grid @ coef, noise, model.ring


def _median(a: np.ndarray) -> np.ndarray:
    """Per-column median of an (N, C) array (upper median; np.median is ~5x slower here)."""
    k = a.shape[0] // 2
    return np.partition(a, k, axis=0)[k]


def _strongest_component(mask: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Boolean mask of the 8-connected component of ``mask`` with the largest total ``weight``.

    Labels horizontal runs rather than pixels: a shape is a few dozen runs, so the
    union-find loop in Python stays tiny and no scipy is needed.
    """
    h, w = mask.shape
    padded = np.zeros((h, w + 2), dtype=np.int8)
    padded[:, 1:-1] = mask
    edges = np.diff(padded, axis=1)
    run_rows, run_starts = np.nonzero(edges == 1)
    _, run_ends = np.nonzero(edges == -1)  # exclusive; same row-major order as the starts
    n = len(run_rows)
    if n == 0:
        return mask.copy()
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    rows, starts, ends = run_rows.tolist(), run_starts.tolist(), run_ends.tolist()
    prev_lo = prev_hi = 0  # runs of the previous row are indices [prev_lo, prev_hi)
    i = 0
    while i < n:
        row = rows[i]
        j = i
        while j < n and rows[j] == row:
            j += 1
        if prev_hi > prev_lo and rows[prev_lo] == row - 1:
            for a in range(i, j):
                for b in range(prev_lo, prev_hi):
                    # 8-connected: runs touch if they overlap after widening by one pixel
                    if starts[a] <= ends[b] and starts[b] <= ends[a]:
                        ra, rb = find(a), find(b)
                        if ra != rb:
                            parent[ra] = rb
        prev_lo, prev_hi, i = i, j, j
    cum = np.zeros((h, w + 1))
    cum[:, 1:] = np.cumsum(weight, axis=1)
    run_weight = cum[run_rows, run_ends] - cum[run_rows, run_starts]
    roots = np.asarray([find(k) for k in range(n)])
    totals = np.bincount(roots, weights=run_weight, minlength=n)
    best = int(np.argmax(totals))
    out = np.zeros((h, w), dtype=bool)
    for k in np.flatnonzero(roots == best).tolist():
        out[rows[k], starts[k]:ends[k]] = True
    return out


def _nearest_color(rgb: np.ndarray) -> str:
    return _PALETTE_NAMES[int(np.argmin(((_PALETTE - rgb) ** 2).sum(axis=1)))]


def _fit_shape(alpha: np.ndarray, window: tuple[int, int, int, int], area: float,
               mx: float, my: float) -> tuple[str, float, float, float, float]:
    """Least-squares template match. Returns (shape, extent, box cx, box cy, residual).

    Each template has the observed area and centroid, so only the outline differs.
    Templates are also tried blurred once and twice, because a blurred square looks
    more like a sharp circle than like a sharp square; the best (shape, blur) pair wins.
    (A per-shape pose search was tried too: ~5x slower for <1 point of accuracy.)
    """
    extents = [float(np.sqrt(area / SHAPE_FILL[shape])) for shape in SHAPES]
    # the triangle's centroid sits extent/6 below the centre of its box
    centers_y = [my - e / 6.0 if shape == "triangle" else my for shape, e in zip(SHAPES, extents)]
    tmpls = np.stack([coverage(shape, mx, cy, e, window, ss=_TEMPLATE_SS)
                      for shape, e, cy in zip(SHAPES, extents, centers_y)])
    sse = np.empty((_BLUR_LEVELS, len(SHAPES)))
    for level in range(_BLUR_LEVELS):
        sse[level] = ((tmpls - alpha) ** 2).sum(axis=(1, 2))
        tmpls = _binomial_blur(tmpls)
    k = int(np.argmin(sse.min(axis=0)))
    return SHAPES[k], extents[k], mx, centers_y[k], float(sse[:, k].min())


def read_image(img: np.ndarray) -> Reading:
    """Find the dominant shape in an image and read its attributes (see module docstring)."""
    rgb = _to_float_rgb(img)
    h, w, _ = rgb.shape
    cell = min(h, w) / 3.0  # shapes-world images are square; min() keeps odd inputs sane

    # 1. background plane and noise level from the border ring
    bg, noise, ring = _background(rgb)

    # 2. smoothed foreground evidence with the noise floor removed
    diff = rgb - bg
    dist = np.sqrt((diff * diff) @ _ONES3)  # matmul: much faster than .sum(axis=2) in numpy
    evidence = _box3(dist)
    evidence -= _median(evidence[ring][:, None])[0]
    peak = float(evidence.max())
    if peak < _MIN_CONTRAST / 2:
        return Reading(found=False)

    # 3. strongest connected component
    comp = _strongest_component(evidence > 0.5 * peak, evidence)
    n_pixels = int(comp.sum())
    if n_pixels > 0.25 * h * w:  # far bigger than any shape: not a shapes-world image
        return Reading(found=False)

    # 4. colour: median of the component's most distant half (its core, free of edge blending)
    comp_dist = dist[comp]
    core = comp_dist >= _median(comp_dist[:, None])[0]
    color = _nearest_color(_median(rgb[comp][core]))
    fg_diff = _median(diff[comp][core])  # shape colour minus the local background
    contrast = float(np.linalg.norm(fg_diff))
    if contrast < max(_MIN_CONTRAST, _NOISE_CONTRAST * noise):
        return Reading(found=False)

    # 5. soft coverage in a window around the component, with area and centroid
    ys, xs = np.nonzero(comp)
    pad = 3
    x0, x1 = max(0, int(xs.min()) - pad), min(w, int(xs.max()) + pad + 1)
    y0, y1 = max(0, int(ys.min()) - pad), min(h, int(ys.max()) + pad + 1)
    axis = (fg_diff / contrast**2).astype(np.float32)
    alpha = np.clip(diff[y0:y1, x0:x1] @ axis, -0.5, 1.5)
    alpha *= _dilate(comp[y0:y1, x0:x1], _MASK_GROW)  # ignore speckles/other blobs in the window
    area = float(alpha.sum())
    if area < _MIN_AREA * cell * cell:  # a noise clump, far smaller than the smallest shape
        return Reading(found=False)
    mx = float(alpha.sum(axis=0) @ (np.arange(x0, x1) + 0.5)) / area
    my = float(alpha.sum(axis=1) @ (np.arange(y0, y1) + 0.5)) / area

    # 6. shape by template matching
    window = (x0, y0, x1 - x0, y1 - y0)
    shape, extent, cx, cy, sse = _fit_shape(alpha, window, area, mx, my)

    # 7. size, position and confidence
    size = "large" if extent / cell > _SIZE_SPLIT else "small"
    col = int(np.clip(cx // (w / 3.0), 0, 2))
    row = int(np.clip(cy // (h / 3.0), 0, 2))
    fit = max(0.0, 1.0 - sse / max(float((alpha * alpha).sum()), 1e-6))
    snr = contrast / max(noise, 1.0)
    confidence = fit * (1.0 - float(np.exp(-((snr / 3.0) ** 2))))
    return Reading(found=True, color=color, shape=shape, row=row, col=col, size=size,
                   centroid=(cx, cy), area=area, confidence=float(confidence))


# --------------------------------------------------------------------------- scoring


def _attrs(spec: ShapeSpec | dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(spec, ShapeSpec):
        return spec.attributes()
    if isinstance(spec, str):
        return parse_caption(spec)
    return dict(spec)


def _compare(reading: Reading, want: dict[str, Any]) -> dict[str, bool]:
    return {
        "color": reading.found and reading.color == want["color"],
        "position": reading.found and (reading.row, reading.col) == (want["row"], want["col"]),
        "shape": reading.found and reading.shape == want["shape"],
        "size": reading.found and reading.size == want["size"],
    }


def score_t2i(img: np.ndarray, spec: ShapeSpec | dict[str, Any] | str) -> dict[str, bool]:
    """Per-attribute correctness of a generated image; ``ok`` is all four together.

    ``spec`` may be a ShapeSpec, an attribute dict (as from ``parse_caption``) or a caption.
    """
    result = _compare(read_image(img), _attrs(spec))
    result["ok"] = all(result.values())
    return result


def score_edit(target_img: np.ndarray, edit: EditSpec, source_img: np.ndarray | None = None) -> dict[str, bool]:
    """changed: the edited attribute now has the requested value; preserved: the other
    attributes still equal the source's. Both are judged against the specs (the ground
    truth), so a misread source image cannot excuse a wrong edit. If ``source_img`` is
    given it is read as a sanity check and reported as ``source_ok``.
    """
    checks = _compare(read_image(target_img), edit.target.attributes())
    key = "position" if edit.kind == "position" else edit.kind
    result = {"changed": checks[key], "preserved": all(v for k, v in checks.items() if k != key)}
    result["ok"] = result["changed"] and result["preserved"]
    if source_img is not None:
        result["source_ok"] = all(_compare(read_image(source_img), edit.source.attributes()).values())
    return result


def _compass(dx: float, dy: float, dead_zone: float) -> tuple[int, int]:
    """One of 8 compass directions as (sign x, sign y); components under dead_zone count as 0."""
    return (int(np.sign(dx)) if abs(dx) >= dead_zone else 0, int(np.sign(dy)) if abs(dy) >= dead_zone else 0)


def score_keyframes(frames: np.ndarray, motion: MotionSpec | dict[str, Any]) -> dict[str, bool]:
    """Score a (K, H, W, 3) keyframe sequence against a motion spec.

    * ``endpoints``: first frame in the start cell and last frame in the end cell.
    * ``direction``: the first->last displacement has the expected 8-way compass
      direction (each axis counts as "no motion" under half a cell). A looser check than
      ``endpoints``, useful to tell "moved the right way, overshot" from "wrong way".
    * ``consistent``: every frame shows the requested colour, shape and size, and the
      centres advance monotonically along the start->end line without straying from it.
    * ``ok`` = endpoints and direction and consistent.
    """
    m = motion if isinstance(motion, dict) else {
        "shape": motion.shape, "color": motion.color, "size": motion.size, "start": motion.start, "end": motion.end}
    frames = np.asarray(frames)
    readings = [read_image(f) for f in frames]
    if len(readings) < 2 or not all(r.found for r in readings):
        return {"endpoints": False, "direction": False, "consistent": False, "ok": False}
    cell = min(frames.shape[1:3]) / 3.0
    first, last = readings[0], readings[-1]
    endpoints = (first.row, first.col) == tuple(m["start"]) and (last.row, last.col) == tuple(m["end"])

    (r0, c0), (r1, c1) = m["start"], m["end"]
    want_dir = _compass(c1 - c0, r1 - r0, 0.5)
    centers = np.asarray([r.centroid for r in readings], dtype=np.float64)
    move = centers[-1] - centers[0]
    direction = _compass(move[0], move[1], 0.5 * cell) == want_dir

    same = all(r.color == m["color"] and r.shape == m["shape"] and r.size == m["size"] for r in readings)
    path = np.asarray([c1 - c0, r1 - r0], dtype=np.float64)
    unit = path / np.linalg.norm(path)
    rel = centers - centers[0]
    along = rel @ unit
    across = rel @ np.asarray([-unit[1], unit[0]])
    monotonic = bool(np.all(np.diff(along) > -0.1 * cell) and along[-1] > 0)
    straight = bool(np.all(np.abs(across) < 0.5 * cell))
    consistent = same and monotonic and straight
    return {"endpoints": endpoints, "direction": direction, "consistent": consistent,
            "ok": endpoints and direction and consistent}


def accuracy(results: list[dict[str, bool]]) -> dict[str, float]:
    """Mean of each boolean key over a list of score dicts (keys missing somewhere are skipped)."""
    if not results:
        return {}
    keys = [k for k in results[0] if all(k in r for r in results)]
    return {k: float(np.mean([bool(r[k]) for r in results])) for k in keys}
