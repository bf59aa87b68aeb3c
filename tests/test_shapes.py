"""Tests for the shapes world generator (difftrain.shapes.world) and its reader (difftrain.shapes.evaluate)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from difftrain.shapes.world import (
    BG_RANGE, COLORS, POSITIONS, SIZE_EXTENT, EditSpec, MotionSpec, ShapeSpec, ShapesWorld, cell_center,
    max_jitter, render, render_at, render_frames, sample_edit, sample_motion, sample_shape,
)
from difftrain.shapes.captions import (
    edit_from_instruction, parse_caption, parse_instruction, parse_instruction_kind, parse_motion, vocabulary,
)
from difftrain.shapes.evaluate import accuracy, read_image, score_edit, score_keyframes, score_t2i

ATTRIBUTES = ("color", "position", "shape", "size")


def degrade(img: np.ndarray, rng: np.random.Generator, sigma: float = 20.0) -> np.ndarray:
    """Mimic a generated sample: mild blur ([1, 2, 1]/4 each axis) then Gaussian pixel noise."""
    x = np.pad(img.astype(np.float32), ((1, 1), (1, 1), (0, 0)), mode="edge")
    x = 0.25 * x[:-2] + 0.5 * x[1:-1] + 0.25 * x[2:]
    x = 0.25 * x[:, :-2] + 0.5 * x[:, 1:-1] + 0.25 * x[:, 2:]
    return np.clip(np.rint(x + rng.normal(0.0, sigma, x.shape)), 0, 255).astype(np.uint8)


def foreground_box(img: np.ndarray, bg: int) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) exclusive bounding box of pixels that differ from the background."""
    ys, xs = np.nonzero((img != bg).any(axis=2))
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


# ------------------------------------------------------------------ generator


def test_render_basic_properties() -> None:
    spec = ShapeSpec("circle", "red", 0, 2, "large", bg=100)
    img = render(spec, 48)
    assert img.shape == (48, 48, 3) and img.dtype == np.uint8
    assert (img[0, 0] == 100).all() and (img[-1, -1] == 100).all()
    cx, cy = cell_center(0, 2, 48)
    assert tuple(img[int(cy), int(cx)]) == COLORS["red"]
    # anti-aliasing: edge pixels are blends, neither pure background nor pure colour
    is_bg = (img == 100).all(axis=2)
    is_fg = (img == np.asarray(COLORS["red"])).all(axis=2)
    assert (~is_bg & ~is_fg).sum() >= 8


@pytest.mark.parametrize("size", [32, 48, 64, 96])
def test_shapes_stay_in_their_cell_and_have_the_right_extent(size: int) -> None:
    rng = np.random.default_rng(size)
    cell = size / 3
    for _ in range(150):
        spec = sample_shape(rng)
        assert abs(spec.dx) <= max_jitter(spec.size) and abs(spec.dy) <= max_jitter(spec.size)
        assert BG_RANGE[0] <= spec.bg <= BG_RANGE[1]
        x0, y0, x1, y1 = foreground_box(render(spec, size), spec.bg)
        assert spec.col * cell - 1 <= x0 and x1 <= (spec.col + 1) * cell + 1, spec
        assert spec.row * cell - 1 <= y0 and y1 <= (spec.row + 1) * cell + 1, spec
        extent = SIZE_EXTENT[spec.size] * cell
        assert abs((x1 - x0) - extent) <= 2.0 and abs((y1 - y0) - extent) <= 2.0, spec


def test_render_is_fast() -> None:
    specs = [sample_shape(np.random.default_rng([9, i])) for i in range(300)]
    best = float("inf")
    for _ in range(3):  # best of 3: the machine is shared
        start = time.perf_counter()
        for spec in specs:
            render(spec, 48)
        best = min(best, (time.perf_counter() - start) / len(specs))
    assert best < 0.5e-3, f"render takes {best * 1e3:.3f} ms per 48x48 image"


def test_edit_specs_change_exactly_one_attribute() -> None:
    rng = np.random.default_rng(3)
    kinds = set()
    for _ in range(400):
        edit = sample_edit(rng)
        src, tgt = edit.source.attributes(), edit.target.attributes()
        changed = {k for k in src if src[k] != tgt[k]}
        expected = {"row", "col"} & changed if edit.kind == "position" else {edit.kind}
        assert changed and changed == expected, edit
        assert edit.target.bg == edit.source.bg
        assert abs(edit.target.dx) <= max_jitter(edit.target.size)
        kinds.add(edit.kind)
    assert kinds == {"color", "position", "shape", "size"}


def test_motion_frames_move_evenly_between_cell_centres() -> None:
    spec = MotionSpec("triangle", "blue", "small", start=(0, 0), end=(2, 1), bg=90, frames=5)
    frames = render_frames(spec, 48)
    assert frames.shape == (5, 48, 48, 3) and frames.dtype == np.uint8
    centers = spec.centers(48)
    assert np.allclose(centers[0], cell_center(0, 0, 48)) and np.allclose(centers[-1], cell_center(2, 1, 48))
    assert np.allclose(np.diff(centers, axis=0), (centers[-1] - centers[0]) / 4)
    assert np.array_equal(frames[2], render_at("triangle", "blue", "small", *centers[2], 90, 48))
    assert spec.caption() == "a small blue triangle moving from the top left to the bottom center"
    with pytest.raises(ValueError):
        MotionSpec("circle", "red", "small", start=(1, 1), end=(1, 1))
    assert ShapesWorld(0, frames=3).keyframes(0)[0].shape == (3, 48, 48, 3)


def test_world_is_deterministic_and_order_independent() -> None:
    a, b = ShapesWorld(5), ShapesWorld(5)
    forward = [a.t2i(i) for i in range(20)]
    backward = [b.t2i(i) for i in reversed(range(20))][::-1]
    for (img1, cap1, spec1), (img2, cap2, spec2) in zip(forward, backward):
        assert np.array_equal(img1, img2) and cap1 == cap2 and spec1 == spec2
    assert np.array_equal(a.edit(7)[1], ShapesWorld(5).edit(7)[1])
    assert np.array_equal(a.keyframes(7)[0], ShapesWorld(5).keyframes(7)[0])
    other = ShapesWorld(6)
    assert sum(np.array_equal(other.t2i(i)[0], forward[i][0]) for i in range(20)) < 3
    # the three tasks draw from different streams even at the same index
    assert a.t2i(3)[2] != a.edit(3)[3].source


def test_edit_kind_weights_reweight_training_edits_and_leave_the_evaluated_world_alone() -> None:
    from difftrain.config import load_config
    from difftrain.shapes import world_from_config
    cfg = load_config(None, ["data.edit_kinds={position=3, color=0}"])
    trained = world_from_config(cfg.data, 3, training=True)
    evaluated = world_from_config(cfg.data, 3)
    n = 3000
    plain = ShapesWorld(3, cfg.data.image_size, cfg.data.frames, tuple(cfg.data.background), cfg.data.motion)
    base = [plain.spec("edit", i).kind for i in range(n)]  # the training split is not quite uniform over kinds
    p = {k: base.count(k) / n for k in ("color", "position", "shape", "size")}
    kinds = [trained.spec("edit", i).kind for i in range(n)]
    assert kinds.count("color") == 0
    share = kinds.count("position") / n
    want = 3 * p["position"] / (3 * p["position"] + p["shape"] + p["size"])
    assert abs(share - want) < 0.03 and share > 2 * p["position"], (share, want)
    for split in ("train", "heldout"):                    # the split still holds under the weights
        ws = trained.with_split(split)
        assert ws.edit_kinds == trained.edit_kinds
        assert sum(ws.spec("edit", i).kind == "position" for i in range(400)) > 200
    assert trained.with_size(64).edit_kinds == trained.edit_kinds
    # the evaluation's world is the unweighted one, example for example
    assert evaluated.edit_kinds is None
    assert all(evaluated.spec("edit", i) == plain.spec("edit", i) for i in range(300))
    # equal weights are the uniform world itself
    assert ShapesWorld(3, edit_kinds={"color": 2, "position": 2, "shape": 2, "size": 2}).edit_kinds is None


@pytest.mark.parametrize("weights, fragment", [
    ({"move": 2}, "unknown kind(s) 'move'"), ({"position": -1}, ">= 0"),
    ({"color": 0, "position": 0, "shape": 0, "size": 0}, "at least one > 0"),
    ({"position": float("inf")}, "finite"), ({"position": 1000}, "1/50"),
])
def test_bad_edit_kind_weights_are_refused(weights, fragment) -> None:
    with pytest.raises(ValueError, match="edit_kinds") as e:
        ShapesWorld(0, edit_kinds=weights)
    assert fragment in str(e.value)


# ------------------------------------------------------------------ text


def test_text_round_trips() -> None:
    rng = np.random.default_rng(11)
    assert parse_caption("a large blue square in the center") == {
        "shape": "square", "color": "blue", "size": "large", "row": 1, "col": 1}
    assert ShapeSpec("circle", "red", 0, 0, "small").caption() == "a small red circle in the top left"
    for _ in range(300):
        spec = sample_shape(rng)
        assert parse_caption(spec.caption()) == spec.attributes()
        edit = sample_edit(rng)
        assert parse_instruction(edit.instruction, edit.source) == edit.target.attributes()
        assert parse_instruction_kind(edit.instruction, edit.source.attributes())[0] == edit.kind
        assert edit_from_instruction(edit.instruction, edit.source).target.attributes() == edit.target.attributes()
        motion = sample_motion(rng)
        parsed = parse_motion(motion.caption())
        assert (parsed["shape"], parsed["color"], parsed["size"], parsed["start"], parsed["end"]) == (
            motion.shape, motion.color, motion.size, motion.start, motion.end)
    # tolerant of case, spacing and a final full stop
    assert parse_caption("A  Small Red circle in the Top Left.")["color"] == "red"


@pytest.mark.parametrize("parser, text", [
    (parse_caption, "a big red circle in the top left"),
    (parse_caption, "a small red circle in the top middle"),
    (parse_motion, "a small red circle moving from the top left to the top left"),
    (parse_motion, "a small red circle in the top left"),
    (lambda t: parse_instruction(t, ShapeSpec("square", "red", 0, 0, "small")), "make the circle blue"),
    (lambda t: parse_instruction(t, ShapeSpec("square", "red", 0, 0, "small")), "paint it blue"),
])
def test_parse_errors_name_the_text(parser, text: str) -> None:
    with pytest.raises(ValueError) as info:
        parser(text)
    assert repr(text) in str(info.value)


def test_vocabulary_covers_all_text() -> None:
    vocab = vocabulary()
    assert vocab == sorted(set(vocab)) and all(w == w.lower() and " " not in w for w in vocab)
    known = set(vocab)
    world = ShapesWorld(2)
    used: set[str] = set()
    for i in range(1000):
        texts = [world.t2i(i)[1], sample_edit(np.random.default_rng([2, i])).instruction,
                 sample_motion(np.random.default_rng([3, i])).caption()]
        for text in texts:
            words = set(text.split(" "))
            assert words <= known, words - known
            used |= words
    assert used == known  # and nothing in the vocabulary is dead weight


# ------------------------------------------------------------------ evaluator


@pytest.mark.parametrize("size", [48, 32])
def test_ground_truth_t2i_accuracy(size: int) -> None:
    world = ShapesWorld(100 + size, size=size)
    acc = accuracy([score_t2i(img, spec) for img, _, spec in map(world.t2i, range(2000))])
    assert all(acc[a] >= 0.99 for a in ATTRIBUTES), acc


def test_ground_truth_accuracy_holds_on_a_wider_background_range() -> None:
    world = ShapesWorld(11, size=48, bg_range=(60, 200))
    shades = set()
    scores = []
    for i in range(600):
        img, _, spec = world.t2i(i)
        shades.add(spec.bg)
        scores.append(score_t2i(img, spec))
    assert min(shades) < 80 and max(shades) > 180
    acc = accuracy(scores)
    assert all(acc[a] >= 0.99 for a in ATTRIBUTES), acc
    with pytest.raises(ValueError, match="bg_range"):
        ShapesWorld(0, bg_range=(200, 100))


def test_across_motions_cross_the_grid_and_land_on_cell_centres() -> None:
    world = ShapesWorld(12, size=48, frames=3, motion="across")
    paths = set()
    for i in range(400):
        frames, caption, spec = world.keyframes(i)
        dr, dc = spec.end[0] - spec.start[0], spec.end[1] - spec.start[1]
        assert dr in (-2, 0, 2) and dc in (-2, 0, 2) and (dr, dc) != (0, 0)
        middle = ((spec.start[0] + spec.end[0]) // 2, (spec.start[1] + spec.end[1]) // 2)
        assert np.allclose(spec.centers(48)[1], cell_center(*middle, 48))
        paths.add((spec.start, spec.end))
        assert score_keyframes(frames, spec)["ok"]
    assert len(paths) == 16
    with pytest.raises(ValueError, match="motion"):
        ShapesWorld(0, motion="zigzag")


def test_ground_truth_edit_accuracy() -> None:
    world = ShapesWorld(7)
    results = []
    for i in range(500):
        source, target, _, spec = world.edit(i)
        results.append(score_edit(target, spec, source if i < 100 else None))
    acc = accuracy(results)
    assert acc["ok"] >= 0.99, acc
    assert accuracy(results[:100])["source_ok"] >= 0.99


def test_ground_truth_keyframe_accuracy() -> None:
    world = ShapesWorld(8)
    acc = accuracy([score_keyframes(frames, spec) for frames, _, spec in map(world.keyframes, range(300))])
    assert acc["ok"] >= 0.99, acc


# At 32 px a small shape is under 5 px wide; after the blur, telling a small circle from
# a small square is near the information limit at this noise (an oracle that knows the
# true colours, background and blur and searches the pose scores ~92.5% on shape), so
# only the 48 px run holds shape to 95%.
@pytest.mark.parametrize("size, n, shape_floor", [(48, 1000, 0.95), (32, 400, 0.80)])
def test_noisy_blurred_accuracy(size: int, n: int, shape_floor: float) -> None:
    world = ShapesWorld(200 + size, size=size)
    rng = np.random.default_rng(size)
    acc = accuracy([score_t2i(degrade(img, rng), spec) for img, _, spec in map(world.t2i, range(n))])
    assert acc["shape"] >= shape_floor, acc
    assert all(acc[a] >= 0.95 for a in ("color", "position", "size")), acc


def test_blank_and_noise_images_are_not_confident() -> None:
    rng = np.random.default_rng(0)
    for size in (32, 48, 96):
        for shade in (0, 128, 255):
            blank = read_image(np.full((size, size, 3), shade, dtype=np.uint8))
            assert not blank.found and blank.confidence == 0.0
        uniform = rng.integers(0, 256, (size, size, 3)).astype(np.uint8)
        gaussian = np.clip(rng.normal(128, 20, (size, size, 3)), 0, 255).astype(np.uint8)
        for img in (uniform, gaussian, rng.random((size, size, 3))):
            assert read_image(img).confidence < 0.3
    clean = read_image(render(ShapeSpec("square", "green", 1, 1, "small", bg=150), 48))
    assert clean.found and clean.confidence > 0.9


def test_input_formats_agree() -> None:
    img = render(ShapeSpec("triangle", "yellow", 2, 0, "large", bg=80), 48)
    as_uint8, as_float = read_image(img), read_image(img.astype(np.float32) / 255.0)
    assert as_uint8.attributes() == as_float.attributes() == {
        "shape": "triangle", "color": "yellow", "size": "large", "row": 2, "col": 0}
    assert read_image(img.mean(axis=2).astype(np.uint8)).shape == "triangle"  # greyscale input
    with pytest.raises(ValueError):
        read_image(np.zeros((48, 48, 5), dtype=np.uint8))


def test_reads_the_main_shape_among_blobs_and_speckles() -> None:
    rng = np.random.default_rng(4)
    main = ShapeSpec("circle", "purple", 0, 0, "large", bg=120)
    img = render(main, 48)
    blob = render_at("square", "cyan", "small", 40.0, 40.0, 120, 48)  # a smaller second shape
    img = np.where((blob != 120).any(axis=2, keepdims=True), blob, img)
    ys, xs = rng.integers(0, 48, 25), rng.integers(0, 48, 25)
    img[ys, xs] = rng.integers(0, 256, (25, 3))  # speckles
    reading = read_image(img)
    assert reading.attributes() == main.attributes(), reading
    # the speckles are not shapes, but the cyan square is: the image is not a picture of one shape
    assert reading.shapes == 2 and not reading.one_shape
    assert not any(score_t2i(img, main).values())


def test_scores_detect_wrong_images() -> None:
    spec = ShapeSpec("square", "blue", 0, 1, "large", bg=70)
    img = render(spec, 48)
    assert score_t2i(img, spec) == {"color": True, "position": True, "shape": True, "size": True, "ok": True,
                                    "one_shape": True}
    assert score_t2i(img, spec.caption())["ok"]
    wrong = score_t2i(img, replace(spec, color="red", row=2))
    assert wrong == {"color": False, "position": False, "shape": True, "size": True, "ok": False,
                     "one_shape": True}
    assert not any(score_t2i(np.full((48, 48, 3), 70, np.uint8), spec).values())

    edit = EditSpec(spec, replace(spec, shape="circle"), "shape", "turn the square into a circle")
    assert score_edit(render(edit.target, 48), edit)["ok"]
    unchanged = score_edit(img, edit)  # the model returned the source untouched
    assert not unchanged["changed"] and unchanged["preserved"] and not unchanged["ok"]
    moved_too = score_edit(render(replace(edit.target, col=2), 48), edit)
    assert moved_too["changed"] and not moved_too["preserved"]

    motion = MotionSpec("circle", "red", "large", start=(0, 0), end=(2, 2), bg=150)
    frames = render_frames(motion, 48)
    assert score_keyframes(frames, motion)["ok"]
    backwards = score_keyframes(frames[::-1], motion)
    assert not backwards["direction"] and not backwards["endpoints"] and not backwards["ok"]
    shuffled = score_keyframes(frames[[0, 2, 1, 3]], motion)
    assert shuffled["endpoints"] and not shuffled["consistent"]
    recoloured = frames.copy()
    recoloured[2] = render_at("circle", "green", "large", *motion.centers(48)[2], 150, 48)
    assert not score_keyframes(recoloured, motion)["consistent"]
    parsed = parse_motion(motion.caption())
    assert score_keyframes(frames, parsed)["ok"]
    assert POSITIONS["bottom right"] == motion.end
