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
8. One shape only. The fitted shape is subtracted from the image (template x measured colour)
   and what is left is searched the way steps 2-3 searched the image, outside a thin band
   (``_EXTRA_BAND``) around the fitted outline: a leftover component whose colour (median of its
   stronger half) differs from the background by ``_EXTRA_CONTRAST`` and whose core covers
   ``_EXTRA_AREA`` of a cell is a second shape. For an edit, the source scene is known; its exact
   footprint is used as a matched filter on what the fitted target leaves unexplained, which
   estimates the opacity of a copy of the source blended into the output (a "ghost": at the
   source's place when the edit moved the shape, in its colour or outline when the edit
   recoloured, reshaped or resized it). A second shape, or a faint copy (opacity from
   ``_GHOST_ALPHA`` up to ``1 - _GHOST_ALPHA``), fails every attribute of the image: the scores
   judge a picture of exactly one shape. An image that reads as the source itself is an edit not
   done, judged by its attributes, not a ghost.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from difftrain.shapes.world import (
    ALL_COLORS, SHAPE_FILL, SHAPES, SIZE_EXTENT, EditSpec, MotionSpec, ShapeSpec, coverage,
)
from difftrain.shapes.captions import parse_caption

# Every colour the world can draw, the fine-tuning concept's included: a model asked for a colour it never learnt is
# read as whatever it drew.
_PALETTE_NAMES = tuple(ALL_COLORS)
_PALETTE = np.asarray([ALL_COLORS[c] for c in _PALETTE_NAMES], dtype=np.float32)
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
# One-shape check (step 8). A second component counts when its median colour is this far from the
# background (about a 20% blend of the least contrasting palette colour over the nearest grey) ...
_EXTRA_CONTRAST = 20.0
# ... and at least this fraction of a cell's area is at half that contrast or more (a quarter of the
# smallest shape, a small triangle, so speckles and thin fitting residue at edges never count).
_EXTRA_AREA = 0.25 * SHAPE_FILL["triangle"] * SIZE_EXTENT["small"] ** 2
_EXTRA_BAND = 1  # pixels around the fitted outline left to the template fit (edge residue is not a shape)
_GHOST_ALPHA = 0.2  # a copy of an edit's source blended in at this opacity (up to 1 - it) fails the image
_GHOST_SNR = 4.0  # ... when the estimate is also this many noise standard deviations above zero
# Weight of the prior that the target keeps its palette contrast (a = 1), relative to the target's
# own energy. It only matters where the data cannot tell a fade from a ghost: a source colour
# blended into a recoloured shape is a fade when the two colours lie on opposite sides of the grey
# (red and cyan, blue and yellow); there the blend is read as a ghost, as strictness requires.
_GHOST_CONTRAST_PRIOR = 0.05
# Target extents tried by the ghost fit, as multiples of the read extent (which a ghost inflates).
_GHOST_SCALES = (0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15)


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
    shapes: int = 0  # shapes seen: 0 (none), 1, or more (the dominant one plus every other component)
    ghost: float = 0.0  # estimated opacity of a copy of ``read_image``'s ``ghost_of`` scene (0 if none given)

    @property
    def one_shape(self) -> bool:
        """Exactly one shape and no ghost of the given source: the only kind of image that can score.

        A ghost is a faint copy: one at ``1 - _GHOST_ALPHA`` opacity or more is the source itself over
        a target that hardly shows, which the attributes judge (and a copy elsewhere is a second shape).
        """
        return self.found and self.shapes == 1 and not _GHOST_ALPHA <= self.ghost <= 1.0 - _GHOST_ALPHA

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


def background_shade(img: np.ndarray) -> float:
    """The image's background lightness (0..255): the mean grey level of the background plane fitted to its
    border ring (``_background``), read from pixels alone. A preference the captions leave free."""
    bg, _, _ = _background(_to_float_rgb(img))
    return float(bg.mean())


def _median(a: np.ndarray) -> np.ndarray:
    """Per-column median of an (N, C) array (upper median; np.median is ~5x slower here)."""
    k = a.shape[0] // 2
    return np.partition(a, k, axis=0)[k]


def _label(mask: np.ndarray) -> np.ndarray:
    """8-connected components of ``mask``: an int32 label image, 0 outside, 1..n inside.

    Labels horizontal runs rather than pixels: a shape is a few dozen runs, so the
    union-find loop in Python stays tiny and no scipy is needed.
    """
    h, w = mask.shape
    padded = np.zeros((h, w + 2), dtype=np.int8)
    padded[:, 1:-1] = mask
    edges = np.diff(padded, axis=1)
    run_rows, run_starts = np.nonzero(edges == 1)
    _, run_ends = np.nonzero(edges == -1)  # exclusive; same row-major order as the starts
    labels = np.zeros((h, w), dtype=np.int32)
    n = len(run_rows)
    if n == 0:
        return labels
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
    roots = [find(k) for k in range(n)]
    ids = {root: k + 1 for k, root in enumerate(dict.fromkeys(roots))}
    for k in range(n):
        labels[rows[k], starts[k]:ends[k]] = ids[roots[k]]
    return labels


def _strongest_component(mask: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Boolean mask of the 8-connected component of ``mask`` with the largest total ``weight``."""
    labels = _label(mask)
    if labels.max() == 0:
        return mask.copy()
    totals = np.bincount(labels.ravel(), weights=weight.ravel().astype(np.float64))
    totals[0] = -np.inf
    return labels == int(np.argmax(totals))


def _nearest_color(rgb: np.ndarray) -> str:
    return _PALETTE_NAMES[int(np.argmin(((_PALETTE - rgb) ** 2).sum(axis=1)))]


def _fit_shape(alpha: np.ndarray, window: tuple[int, int, int, int], area: float,
               mx: float, my: float) -> tuple[str, float, float, float, float, int]:
    """Least-squares template match. Returns (shape, extent, box cx, box cy, residual, blur level).

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
    return SHAPES[k], extents[k], mx, centers_y[k], float(sse[:, k].min()), int(np.argmin(sse[:, k]))


def _coverage_in(shape: str, cx: float, cy: float, extent: float, window: tuple[int, int, int, int]) -> np.ndarray:
    """``coverage`` over ``window``, rasterised only where the shape's box overlaps it (zero elsewhere).

    Keeping the rasterised patch small also keeps its matrix products below the size at which BLAS
    starts worker threads, which on a busy machine costs far more than the arithmetic.
    """
    x0, y0, w, h = window
    half = extent / 2.0
    bx0, bx1 = max(x0, int(np.floor(cx - half)) - 1), min(x0 + w, int(np.ceil(cx + half)) + 1)
    by0, by1 = max(y0, int(np.floor(cy - half)) - 1), min(y0 + h, int(np.ceil(cy + half)) + 1)
    out = np.zeros((h, w), dtype=np.float32)
    if bx1 > bx0 and by1 > by0:
        out[by0 - y0:by1 - y0, bx0 - x0:bx1 - x0] = coverage(
            shape, cx, cy, extent, (bx0, by0, bx1 - bx0, by1 - by0), ss=_TEMPLATE_SS)
    return out


def _template(shape: str, cx: float, cy: float, extent: float, blur: int, h: int, w: int) -> np.ndarray:
    """Coverage of a shape over the whole h x w image, blurred ``blur`` times like the fitted template."""
    t = _coverage_in(shape, cx, cy, extent, (0, 0, w, h))
    for _ in range(blur):
        t = _binomial_blur(t)
    return t


def _other_shapes(diff: np.ndarray, model: np.ndarray, ring: np.ndarray, cell: float) -> int:
    """How many shapes, besides the fitted one, the image shows (step 8 of the module docstring).

    ``diff`` is the image minus its background, ``model`` the fitted shape's share of it.
    """
    resid = diff - model
    evidence = _box3(np.sqrt((resid * resid) @ _ONES3))
    on_ring = evidence[ring]
    floor = float(_median(on_ring[:, None])[0])
    spread = 1.4826 * float(_median(np.abs(on_ring - floor)[:, None])[0])
    outline = _dilate(np.sqrt((model * model) @ _ONES3) > 0.1 * _EXTRA_CONTRAST, _EXTRA_BAND)
    candidates = (evidence - floor > max(0.5 * _EXTRA_CONTRAST, 4.0 * spread)) & ~outline
    if not candidates.any():
        return 0
    labels = _label(candidates)
    min_core = _EXTRA_AREA * cell * cell
    found = 0
    for k in range(1, int(labels.max()) + 1):
        pixels = resid[labels == k]
        if len(pixels) < min_core:
            continue
        # colour of the component's stronger half (the smoothing halo would otherwise outvote a small
        # shape); a speckle or a noise clump has no consistent colour, so its median stays small
        strength = (pixels * pixels) @ _ONES3
        color = _median(pixels[strength >= _median(strength[:, None])[0]])
        contrast = float(np.linalg.norm(color))
        if contrast < _EXTRA_CONTRAST:
            continue
        core = int(((pixels @ (color / contrast)) >= 0.5 * contrast).sum())
        found += core >= min_core
    return found


def _box_window(boxes: list[tuple[float, float, float]], h: int, w: int, pad: int) -> tuple[int, int, int, int]:
    """(x0, y0, width, height) covering squares given as (cx, cy, side), padded and clipped to the image."""
    x0 = max(0, int(np.floor(min(cx - e / 2 for cx, _, e in boxes))) - pad)
    y0 = max(0, int(np.floor(min(cy - e / 2 for _, cy, e in boxes))) - pad)
    x1 = min(w, int(np.ceil(max(cx + e / 2 for cx, _, e in boxes))) + pad)
    y1 = min(h, int(np.ceil(max(cy + e / 2 for _, cy, e in boxes))) + pad)
    return x0, y0, max(1, x1 - x0), max(1, y1 - y0)


def _target_color(core_rgb: np.ndarray, c_s: np.ndarray) -> np.ndarray:
    """The palette colour that, blended with the source colour c_s, best explains the core colour.

    A blend is charged half the colour shift it claims, so a pure colour wins unless the blend
    explains the core colour clearly better.
    """
    best, c_t = np.inf, c_s
    for c_x in _PALETTE:
        d = c_s - c_x
        dd = float(d @ d)
        g = 0.0 if dd == 0 else float(np.clip((core_rgb - c_x) @ d / dd, 0.0, 1.0))
        cost = float(np.linalg.norm(core_rgb - c_x - g * d)) + 0.5 * g * float(np.sqrt(dd))
        if cost < best:
            best, c_t = cost, c_x
    return c_t


def _ghost_opacity(diff: np.ndarray, bg: np.ndarray, core_rgb: np.ndarray, shape: str, cx: float, cy: float,
                   extent: float, source: ShapeSpec, noise: float) -> float:
    """Opacity of a copy of ``source`` blended into an image read as ``shape`` at (cx, cy).

    Model: image - background = a * T * (c_t - bg) + g * S * (c_s - bg - T * (c_t - bg)), that is
    the target shape T (contrast a) with the source S drawn over it at opacity g; T may also shift
    by a fraction of a pixel (linear terms in its x and y gradients). The estimate of g hinges on
    T's outline wherever S borders it, and the read extent is biased by the ghost itself (the
    reading matched its template to the area of both), so T is tried at a range of extents around
    the read one and at each blur level, and the best least-squares fit gives g. The target colour
    c_t is the palette colour that, blended with the source colour, best explains the shape's core
    colour, so a source tint in a recoloured shape is measured as such. Returns 0 when the
    estimate is not significant or when the source hides under the target.
    """
    h, w, _ = diff.shape
    side = min(h, w)
    c_s = np.asarray(ALL_COLORS[source.color], dtype=np.float32)
    c_t = _target_color(core_rgb, c_s)
    sx, sy = source.center(side)
    s_ext = SIZE_EXTENT[source.size] * side / 3.0
    window = _box_window([(sx, sy, s_ext), (cx, cy, extent * max(_GHOST_SCALES))], h, w, pad=4)
    x0, y0, ww, wh = window
    sl = (slice(y0, y0 + wh), slice(x0, x0 + ww))
    y = diff[sl].reshape(-1, 3).astype(np.float64)
    d_s = (c_s - bg[sl]).reshape(-1, 3).astype(np.float64)  # the source's colour over the local background
    d_t = (c_t - bg[sl]).reshape(-1, 3).astype(np.float64)
    # Every column is a per-pixel scalar field times d_t or d_s, so the normal equations need only
    # these per-pixel dot products; all extents of one blur level are then solved at once.
    q_tt, q_ts, q_ss = (d_t * d_t).sum(1), (d_t * d_s).sum(1), (d_s * d_s).sum(1)
    y_t, y_s, yy = (y * d_t).sum(1), (y * d_s).sum(1), float((y * y).sum())
    src = _coverage_in(source.shape, sx, sy, s_ext, window)
    # scaling a triangle keeps its area centroid (what the reading measured), not its box centre
    anchor = cy + extent / 6.0 if shape == "triangle" else cy
    tgts = np.stack([_coverage_in(shape, cx, anchor - extent * k / 6.0 if shape == "triangle" else cy, extent * k,
                                  window) for k in _GHOST_SCALES])
    fit: tuple[float, float, float] | None = None  # (sse, g, energy of g's column not explained by the rest)
    for level in range(_BLUR_LEVELS):
        if level:
            src = _binomial_blur(src)
            tgts = _binomial_blur(tgts)
        gy, gx = np.gradient(tgts, axis=(1, 2))
        k = len(tgts)
        t, gx, gy = (a.reshape(k, -1).astype(np.float64) for a in (tgts, gx, gy))
        sv = src.reshape(-1).astype(np.float64)
        ss_ = sv * sv
        gram = np.empty((k, 4, 4))
        gram[:, 0, 0] = (t * t) @ q_tt
        gram[:, 0, 1] = (t * sv) @ q_ts - (t * t) @ (sv * q_tt)
        gram[:, 0, 2] = (t * gx) @ q_tt
        gram[:, 0, 3] = (t * gy) @ q_tt
        gram[:, 1, 1] = ss_ @ q_ss - 2.0 * t @ (ss_ * q_ts) + (t * t) @ (ss_ * q_tt)
        gram[:, 1, 2] = gx @ (sv * q_ts) - (t * gx) @ (sv * q_tt)
        gram[:, 1, 3] = gy @ (sv * q_ts) - (t * gy) @ (sv * q_tt)
        gram[:, 2, 2] = (gx * gx) @ q_tt
        gram[:, 2, 3] = (gx * gy) @ q_tt
        gram[:, 3, 3] = (gy * gy) @ q_tt
        low = np.tril_indices(4, -1)
        gram[:, low[0], low[1]] = gram[:, low[1], low[0]]
        rhs = np.stack([t @ y_t, np.full(k, float(sv @ y_s)) - t @ (sv * y_t), gx @ y_t, gy @ y_t], axis=1)
        ok = (gram[:, 0, 0] > 0) & (gram[:, 1, 1] > 0)
        if not ok.any():
            continue
        prior = _GHOST_CONTRAST_PRIOR * gram[:, 0, 0]  # pulls a towards 1 (see _GHOST_CONTRAST_PRIOR)
        lhs = gram + 1e-9 * np.trace(gram, axis1=1, axis2=2)[:, None, None] * np.eye(4)
        lhs[:, 0, 0] += prior
        lhs[~ok] = np.eye(4)
        coef = np.linalg.solve(lhs, (rhs + np.outer(prior, [1.0, 0.0, 0.0, 0.0]))[:, :, None])[:, :, 0]
        sse = yy - 2.0 * (coef * rhs).sum(1) + np.einsum("ki,kij,kj->k", coef, gram, coef)
        sse[~ok] = np.inf
        j = int(np.argmin(sse))
        if fit is None or sse[j] < fit[0]:
            fit = (float(sse[j]), float(coef[j, 1]), 1.0 / float(np.linalg.inv(lhs[j])[1, 1]))
    cell = side / 3.0
    # an opaque copy must show at least a minimal extra shape's worth of contrast energy
    min_energy = _EXTRA_AREA * cell * cell * (_EXTRA_CONTRAST / _GHOST_ALPHA) ** 2
    if fit is None or fit[2] < min_energy:
        return 0.0  # the source would hide under the target: even an opaque copy is barely visible
    _, g, energy = fit
    return g if g * np.sqrt(energy) >= _GHOST_SNR * max(noise, 1.0) else 0.0


def read_image(img: np.ndarray, ghost_of: ShapeSpec | None = None) -> Reading:
    """Find the dominant shape in an image and read its attributes (see module docstring).

    ``shapes`` counts every shape seen; ``ghost_of`` (an edit's source) also estimates how much of a
    copy of that scene the image still shows (``ghost``). ``Reading.one_shape`` combines both.
    """
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
    core_rgb = _median(rgb[comp][core])
    color = _nearest_color(core_rgb)
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
    shape, extent, cx, cy, sse, blur = _fit_shape(alpha, window, area, mx, my)

    # 7. size, position and confidence
    size = "large" if extent / cell > _SIZE_SPLIT else "small"
    col = int(np.clip(cx // (w / 3.0), 0, 2))
    row = int(np.clip(cy // (h / 3.0), 0, 2))
    fit = max(0.0, 1.0 - sse / max(float((alpha * alpha).sum()), 1e-6))
    snr = contrast / max(noise, 1.0)
    confidence = fit * (1.0 - float(np.exp(-((snr / 3.0) ** 2))))

    # 8. one shape only: nothing else in what the fitted shape leaves, and no ghost of the source
    target = _template(shape, cx, cy, extent, blur, h, w)
    shapes = 1 + _other_shapes(diff, target[:, :, None] * fg_diff, ring, cell)
    ghost = 0.0
    if ghost_of is not None and (color, shape, size, row, col) != (
            ghost_of.color, ghost_of.shape, ghost_of.size, ghost_of.row, ghost_of.col):
        # (an image that reads as the source itself is an edit not done, not a ghost)
        ghost = _ghost_opacity(diff, bg, core_rgb, shape, cx, cy, extent, ghost_of, noise)
    return Reading(found=True, color=color, shape=shape, row=row, col=col, size=size,
                   centroid=(cx, cy), area=area, confidence=float(confidence), shapes=shapes, ghost=ghost)


# --------------------------------------------------------------------------- scoring


def _attrs(spec: ShapeSpec | dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(spec, ShapeSpec):
        return spec.attributes()
    if isinstance(spec, str):
        return parse_caption(spec)
    return dict(spec)


def _compare(reading: Reading, want: dict[str, Any]) -> dict[str, bool]:
    """Per-attribute agreement; an image that is not exactly one shape (or shows a ghost) fails all."""
    one = reading.one_shape
    return {
        "color": one and reading.color == want["color"],
        "position": one and (reading.row, reading.col) == (want["row"], want["col"]),
        "shape": one and reading.shape == want["shape"],
        "size": one and reading.size == want["size"],
    }


def score_t2i(img: np.ndarray, spec: ShapeSpec | dict[str, Any] | str) -> dict[str, bool]:
    """Per-attribute correctness of a generated image; ``ok`` is all four together.

    ``spec`` may be a ShapeSpec, an attribute dict (as from ``parse_caption``) or a caption.
    ``one_shape``: the image shows exactly one shape; when it does not, every attribute fails.
    """
    reading = read_image(img)
    result = _compare(reading, _attrs(spec))
    result["ok"] = all(result.values())
    result["one_shape"] = reading.one_shape
    return result


def score_edit(target_img: np.ndarray, edit: EditSpec, source_img: np.ndarray | None = None) -> dict[str, bool]:
    """changed: the edited attribute now has the requested value; preserved: the other
    attributes still equal the source's. Both are judged against the specs (the ground
    truth), so a misread source image cannot excuse a wrong edit. ``one_shape``: the output
    shows exactly one shape and no ghost of the source (a faint copy left where the source was,
    or blended into the result); when it does not, changed, preserved and ok all fail. If
    ``source_img`` is given it is read as a sanity check and reported as ``source_ok``.
    """
    reading = read_image(target_img, ghost_of=edit.source)
    checks = _compare(reading, edit.target.attributes())
    key = "position" if edit.kind == "position" else edit.kind
    result = {"changed": checks[key], "preserved": all(v for k, v in checks.items() if k != key)}
    result["ok"] = result["changed"] and result["preserved"]
    result["one_shape"] = reading.one_shape
    if source_img is not None:
        result["source_ok"] = all(_compare(read_image(source_img), edit.source.attributes()).values())
    return result


def _compass(dx: float, dy: float, dead_zone: float) -> tuple[int, int]:
    """One of 8 compass directions as (sign x, sign y); components under dead_zone count as 0."""
    return (int(np.sign(dx)) if abs(dx) >= dead_zone else 0, int(np.sign(dy)) if abs(dy) >= dead_zone else 0)


def score_keyframes(frames: np.ndarray, motion: MotionSpec | dict[str, Any],
                    readings: list[Reading] | None = None) -> dict[str, bool]:
    """Score a (K, H, W, 3) keyframe sequence against a motion spec.

    * ``endpoints``: first frame in the start cell and last frame in the end cell.
    * ``direction``: the first->last displacement has the expected 8-way compass
      direction (each axis counts as "no motion" under half a cell). A looser check than
      ``endpoints``, useful to tell "moved the right way, overshot" from "wrong way".
    * ``consistent``: every frame shows the requested colour, shape and size, and the
      centres advance monotonically along the start->end line without straying from it.
    * ``one_shape``: every frame shows exactly one shape; when one does not, all checks fail.
    * ``ok`` = endpoints and direction and consistent.

    ``readings`` (one ``read_image`` per frame) may be passed when the caller already has them.
    """
    m = motion if isinstance(motion, dict) else {
        "shape": motion.shape, "color": motion.color, "size": motion.size, "start": motion.start, "end": motion.end}
    frames = np.asarray(frames)
    if readings is None:
        readings = [read_image(f) for f in frames]
    one_shape = len(readings) > 0 and all(r.one_shape for r in readings)
    if len(readings) < 2 or not one_shape:
        return {"endpoints": False, "direction": False, "consistent": False, "ok": False, "one_shape": one_shape}
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
            "ok": endpoints and direction and consistent, "one_shape": True}


def accuracy(results: list[dict[str, bool]]) -> dict[str, float]:
    """Mean of each boolean key over a list of score dicts (keys missing somewhere are skipped)."""
    if not results:
        return {}
    keys = [k for k in results[0] if all(k in r for r in results)]
    return {k: float(np.mean([bool(r[k]) for r in results])) for k in keys}


# --------------------------------------------------------------------------- free attributes
# What a caption leaves free, read from pixels: raters' preferences in the preference benchmarks are over these.


def jitter(img: np.ndarray) -> tuple[float, float] | None:
    """The shape's offset from its cell's centre, (x, y), each as a share of the largest jitter the world draws
    for the size read (``world.max_jitter``): -1 the far left / top of what the world draws, +1 the far right /
    bottom (values past +-1 are placements the world never draws). None when no shape is read."""
    from difftrain.shapes.world import cell_center, max_jitter

    r = read_image(img)
    if not r.found or r.centroid is None:
        return None
    h, w = img.shape[:2]
    cx, cy = cell_center(r.row, r.col, w)
    lim = max(max_jitter(r.size), 1e-6) * w
    return (r.centroid[0] - cx) / lim, (r.centroid[1] - cy * h / w) / lim
