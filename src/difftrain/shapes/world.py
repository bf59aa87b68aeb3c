"""The "shapes world": a procedural, fully controllable source of captioned images.

Every example is one coloured shape on a plain grey background, placed in one cell
of a 3x3 grid. Because the generator knows exactly what it drew, the evaluator in
``shapes.evaluate`` can read a generated image back and check it against its prompt,
which lets us measure text-to-image, editing and keyframe models without humans.

Three tasks share the world:

* t2i       -- image + caption ("a small red circle in the top left")
* edit      -- source image, target image, instruction ("make the circle blue")
* keyframes -- K frames of a shape moving in a straight line between two cells

Examples are a pure function of ``(seed, task, index, split)`` so a dataset needs no
storage and every worker can generate any index independently.

Held-out combinations: 18 of the 162 (colour, shape, cell) triples (11%, listed in
``HELDOUT_TRIPLES``) never appear in the ``"train"`` split, neither as a text-to-image
scene, nor as an edit's source or target, nor in any keyframe. The ``"heldout"`` split
yields only examples whose (target) scene is one of them, so evaluation can measure
whether a model composes attributes it has only seen apart. See ``is_heldout``.

Geometry conventions: ``x`` grows to the right, ``y`` grows downwards, pixel
``(i, j)`` covers ``[j, j+1) x [i, i+1)``, so the image centre is ``(size/2, size/2)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from difftrain.config.schema import EDIT_KINDS, edit_kind_weights

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
# Saturated and far apart in RGB (closest pair, blue/purple, is ~115 apart) and at
# least ~100 away from every grey in BG_RANGE, so colour reading stays unambiguous.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
    "purple": (150, 60, 200),
    "cyan": (40, 200, 210),
}
# Colours the world can draw and the evaluator reads, but that no split of the world ever samples: the concept a
# fine-tune teaches a model trained on COLORS (``shapes.concept``). White is ~140 or more from every grey in BG_RANGE
# and ~195 or more from every colour of COLORS, so reading it is as unambiguous as reading them.
NEW_COLORS: dict[str, tuple[int, int, int]] = {"white": (235, 235, 235)}
ALL_COLORS: dict[str, tuple[int, int, int]] = {**COLORS, **NEW_COLORS}
ROWS: tuple[str, ...] = ("top", "middle", "bottom")
COLS: tuple[str, ...] = ("left", "center", "right")
SIZES: tuple[str, ...] = ("small", "large")
# Shape extent (bounding-box side) as a fraction of a grid cell side. "small" was 0.45; at 48 px that
# is a 7-pixel shape, below what a CPU-trained model renders distinctly (it drew small circles and
# triangles as blobs); 0.55 keeps small and large 1.5x apart.
SIZE_EXTENT: dict[str, float] = {"small": 0.55, "large": 0.8}
# Fraction of a cell's area that each shape covers inside its extent x extent box.
# The triangle points up: apex at the top centre, base along the bottom edge.
SHAPE_FILL: dict[str, float] = {"circle": float(np.pi / 4), "square": 1.0, "triangle": 0.5}
# Inclusive grey shades of the background. The shade is not in the caption, so at high noise it is
# variance the model cannot explain; a narrower range lets the prompt's signal (where, what colour)
# dominate the loss sooner: from (60, 200) to (100, 160), a small DiT learned placement from text in
# 3 CPU-minutes instead of not at all.
BG_RANGE: tuple[int, int] = (100, 160)
JITTER_MAX = 0.07  # max centre offset, as a fraction of the image side
CELL_MARGIN = 0.03  # gap kept between the shape's box and its cell edge, in cells
SUPERSAMPLE = 4  # anti-aliasing: coverage is averaged over SUPERSAMPLE^2 samples
TASK_IDS: dict[str, int] = {"t2i": 0, "edit": 1, "keyframes": 2}


def position_name(row: int, col: int) -> str:
    """'top left', 'middle right', ..., but the middle-centre cell is just 'center'."""
    if (row, col) == (1, 1):
        return "center"
    return f"{ROWS[row]} {COLS[col]}"


POSITIONS: dict[str, tuple[int, int]] = {position_name(r, c): (r, c) for r in range(3) for c in range(3)}


# --------------------------------------------------------------------------- held-out combinations
#
# Colour number c (order of COLORS) owns the base cell (r_c, k_c) = _HELDOUT_BASE[c], the six cells off
# the main diagonal in row-major order; shape number s (order of SHAPES) shifts it one row down and one
# column left per step: the triple (colour, shape, cell) is held out when
#     cell == ((r_c + s) % 3, (k_c - s) % 3).
# That is 18 of the 6 x 3 x 9 = 162 triples (11.1%), and the design is balanced so that the held-out
# triples are new combinations of parts that training shows:
#   * every (colour, shape) pair has exactly one held-out cell (8 of its 9 cells are trained);
#   * every colour's three held-out cells lie in three different rows and three different columns;
#   * every cell has exactly two held-out (colour, shape) pairs; every shape's six held-out cells
#     cover each row and each column twice;
#   * every (colour, cell) pair loses at most one of its 3 shapes and every (shape, cell) pair at
#     most one of its 6 colours,
# so every single value and every pair of values still appears in training. Size is not part of it.
SPLITS: tuple[str, ...] = ("train", "heldout")
_HELDOUT_BASE: tuple[tuple[int, int], ...] = ((0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1))


def is_heldout(color: str, shape: str, row: int, col: int) -> bool:
    """Whether the (colour, shape, cell) combination is reserved for the held-out split (never for a NEW_COLORS
    colour, which no split samples)."""
    if color not in COLORS:
        return False
    r, k = _HELDOUT_BASE[tuple(COLORS).index(color)]
    s = SHAPES.index(shape)
    return (int(row), int(col)) == ((r + s) % 3, (k - s) % 3)


HELDOUT_TRIPLES: frozenset[tuple[str, str, tuple[int, int]]] = frozenset(
    (color, shape, cell) for color in COLORS for shape in SHAPES for cell in POSITIONS.values()
    if is_heldout(color, shape, *cell))


def cell_center(row: int, col: int, image_size: int) -> tuple[float, float]:
    """Pixel coordinates (x, y) of the centre of grid cell (row, col)."""
    cell = image_size / 3.0
    return (col + 0.5) * cell, (row + 0.5) * cell


def max_jitter(size_name: str) -> float:
    """Largest centre offset (fraction of image side) that keeps the shape inside its cell."""
    room_cells = 0.5 - SIZE_EXTENT[size_name] / 2 - CELL_MARGIN
    return max(0.0, min(JITTER_MAX, room_cells / 3.0))


def _check(value: str, allowed: tuple[str, ...] | dict[str, Any], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {', '.join(allowed)}")


# --------------------------------------------------------------------------- rendering


@lru_cache(maxsize=256)
def _sample_offsets(n_pixels: int, ss: int) -> np.ndarray:
    """Sub-pixel sample positions for a run of n pixels starting at 0 (cached: hot path)."""
    grid = (np.arange(n_pixels * ss, dtype=np.float32) + 0.5) / ss
    grid.setflags(write=False)
    return grid


@lru_cache(maxsize=256)
def _box_downsample(n_pixels: int, ss: int) -> np.ndarray:
    """(n, n*ss) matrix averaging each run of ss samples; ``D @ x @ D.T`` box-downsamples.

    Two small matmuls are several times faster in numpy than a mean over the
    interleaved axes of a 5-D reshape, and this is the renderer's hot path.
    """
    mat = np.kron(np.eye(n_pixels, dtype=np.float32), np.full((1, ss), 1.0 / ss, dtype=np.float32))
    mat.setflags(write=False)
    return mat


def coverage(
    shape: str, cx: float, cy: float, extent: float, window: tuple[int, int, int, int], ss: int = SUPERSAMPLE
) -> np.ndarray:
    """Anti-aliased coverage in [0, 1] of a shape over a pixel window, shape (height, width).

    ``window`` is ``(x0, y0, width, height)`` in pixels; ``(cx, cy)`` is the centre of
    the shape's bounding box and ``extent`` its side, both in pixels. Only the window
    is rasterised, which keeps rendering cheap. The evaluator reuses this function to
    draw templates, so generator and reader agree exactly on what a shape is.
    """
    x0, y0, w, h = window
    xs = (_sample_offsets(w, ss) + np.float32(x0 - cx))[None, :]  # sample x relative to the centre
    ys = (_sample_offsets(h, ss) + np.float32(y0 - cy))[:, None]
    half = np.float32(extent / 2.0)
    if shape == "circle":
        inside = xs * xs + ys * ys <= half * half
    elif shape == "square":
        inside = (np.abs(ys) <= half) & (np.abs(xs) <= half)
    elif shape == "triangle":
        depth = ys + half  # distance below the apex; the half-width grows as depth / 2
        inside = (np.abs(xs) <= depth / 2) & (ys <= half)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
    # Box-downsample: the mean of each ss x ss block is the pixel's covered fraction.
    return _box_downsample(h, ss) @ inside.astype(np.float32) @ _box_downsample(w, ss).T


def render_at(
    shape: str, color: str, size_name: str, cx: float, cy: float, bg: int, image_size: int = 48
) -> np.ndarray:
    """Render one shape centred at pixel coordinates (cx, cy); returns (H, W, 3) uint8."""
    _check(color, ALL_COLORS, "color")
    _check(size_name, SIZES, "size")
    image = np.full((image_size, image_size, 3), bg, dtype=np.uint8)
    extent = SIZE_EXTENT[size_name] * image_size / 3.0
    half = extent / 2.0
    x0, y0 = max(0, int(np.floor(cx - half))), max(0, int(np.floor(cy - half)))
    x1 = min(image_size, int(np.ceil(cx + half)))
    y1 = min(image_size, int(np.ceil(cy + half)))
    if x1 <= x0 or y1 <= y0:
        return image  # entirely off-canvas
    alpha = coverage(shape, cx, cy, extent, (x0, y0, x1 - x0, y1 - y0))[:, :, None]
    fg = np.asarray(ALL_COLORS[color], dtype=np.float32)
    patch = np.float32(bg) + (fg - np.float32(bg)) * alpha
    image[y0:y1, x0:x1] = np.rint(patch).astype(np.uint8)
    return image


# --------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class ShapeSpec:
    """One static scene. ``dx``/``dy`` are the centre's jitter as fractions of the image side."""

    shape: str
    color: str
    row: int
    col: int
    size: str
    bg: int = 128
    dx: float = 0.0
    dy: float = 0.0

    def __post_init__(self) -> None:
        _check(self.shape, SHAPES, "shape")
        _check(self.color, ALL_COLORS, "color")
        _check(self.size, SIZES, "size")
        if not (0 <= self.row < 3 and 0 <= self.col < 3):
            raise ValueError(f"grid cell ({self.row}, {self.col}) is outside the 3x3 grid")
        if not 0 <= self.bg <= 255:
            raise ValueError(f"background shade {self.bg} is outside 0..255")

    @property
    def position_name(self) -> str:
        return position_name(self.row, self.col)

    def caption(self) -> str:
        return f"a {self.size} {self.color} {self.shape} in the {self.position_name}"

    def attributes(self) -> dict[str, Any]:
        """The attributes a caption describes (what the evaluator checks)."""
        return {"shape": self.shape, "color": self.color, "size": self.size, "row": self.row, "col": self.col}

    def center(self, image_size: int) -> tuple[float, float]:
        cx, cy = cell_center(self.row, self.col, image_size)
        return cx + self.dx * image_size, cy + self.dy * image_size


def render(spec: ShapeSpec, size: int = 48) -> np.ndarray:
    """Render a ShapeSpec as an (size, size, 3) uint8 image."""
    cx, cy = spec.center(size)
    return render_at(spec.shape, spec.color, spec.size, cx, cy, spec.bg, size)


def instruction_for(kind: str, source: ShapeSpec, target: ShapeSpec) -> str:
    """Natural-language instruction that turns ``source`` into ``target``."""
    if kind == "color":
        return f"make the {source.shape} {target.color}"
    if kind == "position":
        return f"move it to the {target.position_name}"
    if kind == "shape":
        return f"turn the {source.shape} into a {target.shape}"
    if kind == "size":
        return f"make it {target.size}"
    raise ValueError(f"unknown edit kind {kind!r}; expected one of {', '.join(EDIT_KINDS)}")


@dataclass(frozen=True)
class EditSpec:
    """An edit triple: exactly one attribute (``kind``) differs between source and target."""

    source: ShapeSpec
    target: ShapeSpec
    kind: str
    instruction: str


def apply_edit(source: ShapeSpec, kind: str, value: Any) -> EditSpec:
    """Build the EditSpec changing one attribute; value is a name, or (row, col) for position.

    The background shade is kept; the jitter is kept too, except that it is clamped
    when a shape grows, so a large shape still fits in its cell.
    """
    if kind == "color":
        target = replace(source, color=value)
    elif kind == "shape":
        target = replace(source, shape=value)
    elif kind == "position":
        target = replace(source, row=int(value[0]), col=int(value[1]))
    elif kind == "size":
        lim = max_jitter(value)
        target = replace(source, size=value, dx=float(np.clip(source.dx, -lim, lim)),
                         dy=float(np.clip(source.dy, -lim, lim)))
    else:
        raise ValueError(f"unknown edit kind {kind!r}; expected one of {', '.join(EDIT_KINDS)}")
    return EditSpec(source, target, kind, instruction_for(kind, source, target))


@dataclass(frozen=True)
class MotionSpec:
    """A shape moving in a straight line between two cell centres over ``frames`` frames."""

    shape: str
    color: str
    size: str
    start: tuple[int, int]
    end: tuple[int, int]
    bg: int = 128
    frames: int = 4

    def __post_init__(self) -> None:
        _check(self.shape, SHAPES, "shape")
        _check(self.color, COLORS, "color")
        _check(self.size, SIZES, "size")
        for cell in (self.start, self.end):
            if not (0 <= cell[0] < 3 and 0 <= cell[1] < 3):
                raise ValueError(f"grid cell {cell} is outside the 3x3 grid")
        if tuple(self.start) == tuple(self.end):
            raise ValueError(f"motion must move: start and end are both {self.start}")
        if self.frames < 2:
            raise ValueError(f"a motion needs at least 2 frames, got {self.frames}")

    def caption(self) -> str:
        return (f"a {self.size} {self.color} {self.shape} moving from the "
                f"{position_name(*self.start)} to the {position_name(*self.end)}")

    def centers(self, image_size: int) -> np.ndarray:
        """(frames, 2) pixel centres, evenly spaced from start cell centre to end cell centre."""
        a = np.asarray(cell_center(*self.start, image_size))
        b = np.asarray(cell_center(*self.end, image_size))
        t = np.linspace(0.0, 1.0, self.frames)[:, None]
        return a + t * (b - a)


def render_frames(spec: MotionSpec, size: int = 48) -> np.ndarray:
    """Render a MotionSpec as a (frames, size, size, 3) uint8 array."""
    return np.stack([render_at(spec.shape, spec.color, spec.size, float(x), float(y), spec.bg, size)
                     for x, y in spec.centers(size)])


def _cells_at(u: float) -> tuple[int, ...]:
    """Grid indices whose span [k, k+1) holds coordinate u (in cells); both neighbours on a boundary."""
    lo, hi = int(np.floor(u - 1e-6)), int(np.floor(u + 1e-6))
    return tuple(k for k in sorted({lo, hi}) if 0 <= k < 3)


def motion_frame_cells(spec: MotionSpec) -> list[tuple[tuple[int, int], ...]]:
    """Per frame, the grid cell(s) holding the shape's centre; a centre on a cell boundary counts for
    every cell it touches. Independent of the image size (computed in cell units)."""
    out = []
    for t in np.linspace(0.0, 1.0, spec.frames):
        r = spec.start[0] + 0.5 + t * (spec.end[0] - spec.start[0])
        c = spec.start[1] + 0.5 + t * (spec.end[1] - spec.start[1])
        out.append(tuple((i, j) for i in _cells_at(r) for j in _cells_at(c)))
    return out


def spec_is_heldout(spec: ShapeSpec | EditSpec | MotionSpec) -> bool:
    """Whether an example belongs to the held-out split: a scene whose triple is held out, an edit
    whose target is, a motion with any frame whose (colour, shape, cell) is."""
    if isinstance(spec, ShapeSpec):
        return is_heldout(spec.color, spec.shape, spec.row, spec.col)
    if isinstance(spec, EditSpec):
        return spec_is_heldout(spec.target)
    if isinstance(spec, MotionSpec):
        return any(is_heldout(spec.color, spec.shape, *cell) for cells in motion_frame_cells(spec) for cell in cells)
    raise TypeError(f"expected a ShapeSpec, EditSpec or MotionSpec, got {type(spec).__name__}")


def spec_touches_heldout(spec: ShapeSpec | EditSpec | MotionSpec) -> bool:
    """Whether any scene an example shows is held out (for an edit: the source or the target)."""
    if isinstance(spec, EditSpec):
        return spec_is_heldout(spec.source) or spec_is_heldout(spec.target)
    return spec_is_heldout(spec)


# --------------------------------------------------------------------------- sampling


def _pick(rng: np.random.Generator, options: tuple[Any, ...] | list[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


def _bg(rng: np.random.Generator, bg_range: tuple[int, int] | None) -> int:
    lo, hi = bg_range or BG_RANGE
    return int(rng.integers(lo, hi + 1))


def sample_shape(rng: np.random.Generator, bg_range: tuple[int, int] | None = None) -> ShapeSpec:
    size = _pick(rng, SIZES)
    lim = max_jitter(size)
    return ShapeSpec(
        shape=_pick(rng, SHAPES), color=_pick(rng, tuple(COLORS)), row=int(rng.integers(3)),
        col=int(rng.integers(3)), size=size, bg=_bg(rng, bg_range),
        dx=float(rng.uniform(-lim, lim)), dy=float(rng.uniform(-lim, lim)),
    )


def sample_edit(rng: np.random.Generator, bg_range: tuple[int, int] | None = None) -> EditSpec:
    source = sample_shape(rng, bg_range)
    kind = _pick(rng, EDIT_KINDS)
    if kind == "color":
        value = _pick(rng, [c for c in COLORS if c != source.color])
    elif kind == "shape":
        value = _pick(rng, [s for s in SHAPES if s != source.shape])
    elif kind == "size":
        value = "large" if source.size == "small" else "small"
    else:
        value = _pick(rng, [cell for cell in POSITIONS.values() if cell != (source.row, source.col)])
    return apply_edit(source, kind, value)


def _across(start: tuple[int, int], end: tuple[int, int]) -> bool:
    """Start and end two cells apart on every axis that moves (row, column or diagonal through the middle)."""
    dr, dc = end[0] - start[0], end[1] - start[1]
    return (dr, dc) != (0, 0) and dr in (-2, 0, 2) and dc in (-2, 0, 2)


def sample_motion(rng: np.random.Generator, frames: int = 4, bg_range: tuple[int, int] | None = None,
                  motion: str = "any") -> MotionSpec:
    """``motion='any'``: any start and end cell; ``'across'``: the 16 straight paths that cross the grid
    (two cells on each moving axis), so with an odd frame count every frame sits on a cell centre
    or halfway between two."""
    cells = list(POSITIONS.values())
    if motion not in ("any", "across"):
        raise ValueError(f"motion must be 'any' or 'across', got {motion!r}")
    if motion == "across":
        start = _pick(rng, [c for c in cells if c != (1, 1)])
        end = _pick(rng, [c for c in cells if _across(start, c)])
    else:
        start = _pick(rng, cells)
        end = _pick(rng, [c for c in cells if c != start])
    return MotionSpec(shape=_pick(rng, SHAPES), color=_pick(rng, tuple(COLORS)), size=_pick(rng, SIZES),
                      start=start, end=end, bg=_bg(rng, bg_range), frames=frames)


_SPEC_MEMO = 8192  # specs a world keeps (a step's global batch is read twice: its prompts, then its pixels)
_MAX_DRAWS = 1000  # rejection sampling per example; a split keeps >= 1/9 of draws, so this never runs out


class ShapesWorld:
    """Indexable procedural dataset; example i depends only on (seed, task, i, split).

    ``split="train"`` never shows a held-out (colour, shape, cell) triple anywhere (see
    ``HELDOUT_TRIPLES``); ``split="heldout"`` yields only examples whose scene (for an edit, its
    target; for keyframes, some frame) is held out. Both draw from the same distribution as the
    unrestricted world, conditioned by rejection on the split, from one generator per example.

    ``edit_kinds`` (training only) reweights the kinds of edit: an edit of kind k is kept with probability
    ``edit_kinds[k] / max(edit_kinds)`` (a kind not named weighs 1), by rejection from the example's own
    generator, so the world stays a pure function of its arguments. Without it every kind is equally likely,
    as the evaluation draws them.
    """

    def __init__(self, seed: int, size: int = 48, frames: int = 4,
                 bg_range: tuple[int, int] | None = None, motion: str = "any", split: str = "train",
                 edit_kinds: dict[str, float] | None = None) -> None:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.seed, self.size, self.frames = int(seed), int(size), int(frames)
        self.bg_range = tuple(bg_range) if bg_range is not None else BG_RANGE
        if not 0 <= self.bg_range[0] <= self.bg_range[1] <= 255:
            raise ValueError(f"bg_range must be 0 <= lo <= hi <= 255, got {self.bg_range}")
        if motion not in ("any", "across"):
            raise ValueError(f"motion must be 'any' or 'across', got {motion!r}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        self.motion, self.split = motion, split
        self.edit_kinds = edit_kind_weights(edit_kinds)
        # The specs drawn last (immutable), so a loader that reads a step's prompts and then renders the same
        # examples draws each spec once; bounded, and a pure cache: the world stays a function of its arguments.
        self._specs: dict[tuple[str, int], ShapeSpec | EditSpec | MotionSpec] = {}

    def with_split(self, split: str) -> "ShapesWorld":
        """The same world (seed, size, frames, background, motion, edit kinds) restricted to another split."""
        return ShapesWorld(self.seed, self.size, self.frames, self.bg_range, self.motion, split, self.edit_kinds)

    def with_size(self, size: int) -> "ShapesWorld":
        """The same world drawn at another scene size."""
        world = ShapesWorld(self.seed, size, self.frames, self.bg_range, self.motion, self.split, self.edit_kinds)
        world._specs = self._specs          # a spec does not depend on the size it is drawn at
        return world

    def _rng(self, task: str, index: int) -> np.random.Generator:
        if index < 0:
            raise IndexError(f"example index must be >= 0, got {index}")
        # A fresh generator per example: results never depend on call order. The training split keeps
        # the original stream (so its examples match the unrestricted world's whenever they qualify).
        key = [self.seed, TASK_IDS[task], int(index)] + ([] if self.split == "train" else [SPLITS.index(self.split)])
        return np.random.default_rng(key)

    def _draw(self, task: str, rng: np.random.Generator) -> ShapeSpec | EditSpec | MotionSpec:
        if task == "t2i":
            return sample_shape(rng, self.bg_range)
        if task == "edit":
            return sample_edit(rng, self.bg_range)
        if task == "keyframes":
            return sample_motion(rng, self.frames, self.bg_range, self.motion)
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASK_IDS)}")

    def _accepts(self, spec: ShapeSpec | EditSpec | MotionSpec) -> bool:
        if self.split == "train":
            return not spec_touches_heldout(spec)
        return spec_is_heldout(spec)

    def spec(self, task: str, index: int) -> ShapeSpec | EditSpec | MotionSpec:
        """The spec of example ``index`` of ``task`` in this split, without rendering it."""
        key = (task, int(index))
        spec = self._specs.get(key)
        if spec is None:
            spec = self._draw_spec(task, index)
            if len(self._specs) >= _SPEC_MEMO:
                self._specs.clear()
            self._specs[key] = spec
        return spec

    def _draw_spec(self, task: str, index: int) -> ShapeSpec | EditSpec | MotionSpec:
        rng = self._rng(task, index)
        for _ in range(_MAX_DRAWS):
            spec = self._draw(task, rng)
            if not self._accepts(spec):
                continue
            if self.edit_kinds is not None and task == "edit":
                keep = self.edit_kinds[spec.kind]
                if keep < 1.0 and rng.random() >= keep:
                    continue
            return spec
        raise RuntimeError(f"no {self.split} example found for {task} index {index}")  # pragma: no cover

    def t2i(self, index: int) -> tuple[np.ndarray, str, ShapeSpec]:
        spec = self.spec("t2i", index)
        return render(spec, self.size), spec.caption(), spec

    def edit(self, index: int) -> tuple[np.ndarray, np.ndarray, str, EditSpec]:
        spec = self.spec("edit", index)
        return render(spec.source, self.size), render(spec.target, self.size), spec.instruction, spec

    def keyframes(self, index: int) -> tuple[np.ndarray, str, MotionSpec]:
        spec = self.spec("keyframes", index)
        return render_frames(spec, self.size), spec.caption(), spec

    def prompt(self, task: str, index: int) -> str:
        """The caption (or edit instruction) of an example, without rendering it."""
        spec = self.spec(task, index)
        return spec.instruction if isinstance(spec, EditSpec) else spec.caption()
