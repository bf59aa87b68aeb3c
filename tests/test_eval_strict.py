"""Strict shapes evaluation: held-out attribute combinations, one shape per image, seen/held-out reports."""

from __future__ import annotations

from dataclasses import replace
from itertools import product
from types import SimpleNamespace

import numpy as np
import pytest

import difftrain.evaluate as evaluate_mod
from difftrain.shapes.world import (
    COLORS, HELDOUT_TRIPLES, POSITIONS, SHAPES, SIZE_EXTENT, ShapeSpec, ShapesWorld, coverage, is_heldout,
    sample_shape,
)
from difftrain.shapes.evaluate import read_image, score_edit, score_keyframes, score_t2i
from difftrain.evaluate import EVAL_KEYS, evaluate, generate_task

CELLS = tuple(POSITIONS.values())
T2I_ATTRIBUTES = ("color", "position", "shape", "size", "ok")
EDIT_RESULTS = ("changed", "preserved", "ok")


def blend(img: np.ndarray, spec: ShapeSpec, alpha: float) -> np.ndarray:
    """Draw ``spec``'s shape over ``img`` at opacity ``alpha`` (anti-aliased, like the renderer)."""
    size = img.shape[0]
    cx, cy = spec.center(size)
    cov = coverage(spec.shape, cx, cy, SIZE_EXTENT[spec.size] * size / 3.0, (0, 0, size, size))[:, :, None]
    color = np.asarray(COLORS[spec.color], dtype=np.float32)
    out = img.astype(np.float32) + alpha * cov * (color - img.astype(np.float32))
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def frame_cells_from_pixels(spec, size: int) -> list[set[tuple[int, int]]]:
    """Cells each rendered frame's centre lies in, from pixel coordinates (both cells on a boundary)."""
    cell = size / 3.0
    out = []
    for x, y in spec.centers(size):
        cols = {int(np.clip(np.floor(x / cell + d), 0, 2)) for d in (-1e-6, 1e-6)}
        rows = {int(np.clip(np.floor(y / cell + d), 0, 2)) for d in (-1e-6, 1e-6)}
        out.append({(r, c) for r in rows for c in cols})
    return out


# ------------------------------------------------------------------ held-out combinations


def test_heldout_set_is_balanced_and_every_part_is_still_trained() -> None:
    everything = set(product(COLORS, SHAPES, CELLS))
    assert HELDOUT_TRIPLES <= everything and len(HELDOUT_TRIPLES) == 18
    assert 0.10 <= len(HELDOUT_TRIPLES) / len(everything) <= 0.15
    assert all(is_heldout(c, s, *cell) == ((c, s, cell) in HELDOUT_TRIPLES) for c, s, cell in everything)
    trained = everything - HELDOUT_TRIPLES
    # every single value, and every pair of values, still appears in training
    assert {t[0] for t in trained} == set(COLORS) and {t[1] for t in trained} == set(SHAPES)
    assert {t[2] for t in trained} == set(CELLS)
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert {(t[i], t[j]) for t in trained} == {(t[i], t[j]) for t in everything}
    # balanced: one held-out cell per (colour, shape), two held-out triples per cell
    for color, shape in product(COLORS, SHAPES):
        assert sum((color, shape, cell) in HELDOUT_TRIPLES for cell in CELLS) == 1
    for cell in CELLS:
        assert sum(t[2] == cell for t in HELDOUT_TRIPLES) == 2
    for color in COLORS:  # a colour's held-out cells: three rows, three columns
        cells = [t[2] for t in HELDOUT_TRIPLES if t[0] == color]
        assert {r for r, _ in cells} == {c for _, c in cells} == {0, 1, 2}
    for shape in SHAPES:  # a shape's held-out cells: each row and each column twice
        cells = [t[2] for t in HELDOUT_TRIPLES if t[1] == shape]
        assert len(set(cells)) == 6
        assert all(sum(r == i for r, _ in cells) == sum(c == i for _, c in cells) == 2 for i in range(3))


@pytest.mark.parametrize("size, frames, motion", [(48, 4, "any"), (32, 3, "across")])
def test_training_world_never_shows_a_heldout_triple(size: int, frames: int, motion: str) -> None:
    world = ShapesWorld(3, size=size, frames=frames, motion=motion)
    assert world.split == "train"
    for i in range(1500):
        t2i = world.spec("t2i", i)
        assert not is_heldout(t2i.color, t2i.shape, t2i.row, t2i.col)
        edit = world.spec("edit", i)
        for scene in (edit.source, edit.target):
            assert not is_heldout(scene.color, scene.shape, scene.row, scene.col), edit
        motion_spec = world.spec("keyframes", i)
        for cells in frame_cells_from_pixels(motion_spec, size):
            assert not any(is_heldout(motion_spec.color, motion_spec.shape, *c) for c in cells), motion_spec
    # the rendering API returns the same examples
    img, caption, spec = world.t2i(7)
    assert spec == world.spec("t2i", 7) and caption == world.prompt("t2i", 7) == spec.caption()
    assert world.edit(7)[3] == world.spec("edit", 7) and world.prompt("edit", 7) == world.edit(7)[2]
    assert world.keyframes(7)[2] == world.spec("keyframes", 7)


def test_heldout_world_only_shows_heldout_targets() -> None:
    world = ShapesWorld(3, size=48, frames=4, split="heldout")
    seen_triples = set()
    for i in range(400):
        t2i = world.spec("t2i", i)
        assert is_heldout(t2i.color, t2i.shape, t2i.row, t2i.col)
        seen_triples.add((t2i.color, t2i.shape, (t2i.row, t2i.col)))
        edit = world.spec("edit", i)
        assert is_heldout(edit.target.color, edit.target.shape, edit.target.row, edit.target.col), edit
        m = world.spec("keyframes", i)
        assert any(is_heldout(m.color, m.shape, *c) for cells in frame_cells_from_pixels(m, 48) for c in cells), m
    assert seen_triples == set(HELDOUT_TRIPLES)  # and all of them come up
    with pytest.raises(ValueError, match="split"):
        ShapesWorld(0, split="test")


def test_split_examples_depend_only_on_seed_task_index_and_split() -> None:
    a, b = ShapesWorld(5), ShapesWorld(5)
    assert [a.spec("edit", i) for i in range(30)] == [b.spec("edit", i) for i in reversed(range(30))][::-1]
    held = a.with_split("heldout")
    assert (held.seed, held.size, held.frames, held.bg_range, held.motion) == (5, 48, 4, a.bg_range, "any")
    assert held.spec("t2i", 3) == ShapesWorld(5, split="heldout").spec("t2i", 3)
    assert sum(held.spec("t2i", i) == a.spec("t2i", i) for i in range(50)) == 0
    assert np.array_equal(held.keyframes(4)[0], ShapesWorld(5, split="heldout").keyframes(4)[0])
    assert held.with_split("train").spec("t2i", 9) == a.spec("t2i", 9)


# ------------------------------------------------------------------ one shape only


@pytest.mark.parametrize("size", [48, 32])
def test_ground_truth_scores_everything_right(size: int) -> None:
    for split in ("train", "heldout"):
        world = ShapesWorld(31, size=size, frames=3, motion="across", split=split)
        for i in range(120):
            img, _, spec = world.t2i(i)
            assert all(score_t2i(img, spec).values()), (split, spec)
            source, target, _, edit = world.edit(i)
            assert all(score_edit(target, edit, source).values()), (split, edit)
        for i in range(40):
            frames, _, motion = world.keyframes(i)
            assert all(score_keyframes(frames, motion).values()), (split, motion)


@pytest.mark.parametrize("size", [48, 32])
def test_a_second_shape_fails_every_attribute(size: int) -> None:
    world = ShapesWorld(41, size=size)
    rng = np.random.default_rng(size)
    for i in range(60):
        img, _, spec = world.t2i(i)
        other = sample_shape(rng)
        while (other.row, other.col) == (spec.row, spec.col):
            other = sample_shape(rng)
        for alpha in (1.0, 0.3):  # a full second shape, and a faint one
            two = blend(img, replace(other, bg=spec.bg), alpha)
            score = score_t2i(two, spec)
            assert not any(score.values()), (spec, other, alpha, read_image(two))
            assert read_image(two).shapes >= 2


def test_a_second_shape_in_a_keyframe_fails_the_sequence() -> None:
    world = ShapesWorld(42, size=48, frames=4)
    frames, _, motion = world.keyframes(0)
    assert score_keyframes(frames, motion)["ok"]
    bad = frames.copy()
    start = ShapeSpec(motion.shape, motion.color, *motion.start, motion.size, bg=motion.bg)
    bad[2] = blend(bad[2], start, 0.3)  # a faint copy of the first frame left behind
    if bad[2].tobytes() == frames[2].tobytes():  # pragma: no cover - the copy must show
        pytest.fail("the blended copy did not change the frame")
    assert not any(score_keyframes(bad, motion).values())


def _visible_ghost_edits(world: ShapesWorld, n: int) -> list[tuple]:
    """Edits where the source shows outside the target: moved, recoloured, shrunk, or reshaped to a
    shape that does not cover it (any source -> triangle, square -> circle)."""
    out = []
    i = 0
    while len(out) < n:
        source, target, _, edit = world.edit(i)
        i += 1
        visible = (edit.kind in ("position", "color") or (edit.kind == "size" and edit.target.size == "small")
                   or (edit.kind == "shape" and (edit.target.shape == "triangle"
                                                 or (edit.source.shape, edit.target.shape) == ("square", "circle"))))
        if visible:
            out.append((source, target, edit))
    return out


@pytest.mark.parametrize("size, n", [(48, 80), (32, 40)])
def test_a_ghost_of_the_edit_source_fails_every_attribute(size: int, n: int) -> None:
    kinds = set()
    for source, target, edit in _visible_ghost_edits(ShapesWorld(43, size=size), n):
        kinds.add(edit.kind)
        assert all(score_edit(target, edit).values())  # the clean target passes ...
        ghosted = blend(target, edit.source, 0.3)       # ... with the source blended in at 30% it fails
        score = score_edit(ghosted, edit, source)
        assert not any(score[k] for k in EDIT_RESULTS + ("one_shape",)), (edit, read_image(ghosted, edit.source))
        assert read_image(ghosted, ghost_of=edit.source).ghost >= 0.2
    assert kinds == {"color", "position", "shape", "size"}


def test_unchanged_source_is_a_failed_edit_not_a_ghost() -> None:
    world = ShapesWorld(44, size=48)
    for i in range(40):
        source, _, _, edit = world.edit(i)
        score = score_edit(source, edit)  # the model returned its input untouched
        assert score["one_shape"] and not score["changed"] and score["preserved"] and not score["ok"]


# ------------------------------------------------------------------ evaluate()


class _Oracle:
    """A stand-in pipeline that 'generates' the ground truth, optionally spoilt by ``spoil``."""

    def __init__(self, spoil=None):
        self.autoencoder, self.text_encoder = None, SimpleNamespace(tokenize=None)
        self.spoil, self.calls = spoil, []

    def sample(self, batch, steps, cfg_scale, seed=0):
        return batch

    def to_images(self, batch):
        out = batch.pixels.copy()
        if self.spoil is not None:
            for b, m in enumerate(batch.meta):
                out[b] = self.spoil(batch.task, out[b], m)
        return out


def _fake_make_batch(pipe_calls):
    def make(world, autoencoder, tokenize, task, indices, targets=None, canvas=None):
        pipe_calls.append((world.split, task, tuple(indices), None if targets is None else targets[0]))
        frames, prompts, meta = [], [], []
        for i in indices:
            if task == "t2i":
                img, prompt, spec = world.t2i(i)
                frames.append(img[None])
                meta.append({"index": i, "spec": spec})
            elif task == "edit":
                src, tgt, prompt, spec = world.edit(i)
                frames.append(np.stack([tgt, src]))
                meta.append({"index": i, "spec": spec, "source": src})
            else:
                seq, prompt, spec = world.keyframes(i)
                frames.append(seq)
                meta.append({"index": i, "spec": spec, "frames": seq})
            prompts.append(prompt)
        return SimpleNamespace(pixels=np.stack(frames), prompts=prompts, meta=meta, task=task)
    return make


@pytest.fixture
def oracle(monkeypatch):
    calls: list = []
    monkeypatch.setattr(evaluate_mod, "make_batch", _fake_make_batch(calls))
    return calls


def test_evaluate_reports_seen_heldout_and_both_keyframe_modes(oracle) -> None:
    world = ShapesWorld(12345, size=48, frames=3, motion="across")
    metrics, gens = evaluate(_Oracle(), world, 6, steps=2, cfg_scale=1.0, keyframe_given="none")
    assert set(EVAL_KEYS) <= set(metrics) and metrics["n"] == 6
    assert all(metrics[k] == 1.0 for k in EVAL_KEYS if k != "n"), metrics
    assert metrics["keyframe_acc"] == metrics["keyframe_acc_none"]
    # seen prompts come from the training split, held-out ones from the held-out split, same seed
    assert {(split, task) for split, task, _, _ in oracle} == {
        (s, t) for s in ("train", "heldout") for t in ("t2i", "edit", "keyframes")}
    assert [tuple(t) for s, task, _, t in oracle if task == "keyframes"] == [
        (True, True, True), (False, True, True)] * 2   # none, then first given; seen, then held out
    held = [g for g in gens if g.split == "heldout"]
    assert len(held) == len(gens) / 2 == 6 * 4
    assert held[0].prompt == world.with_split("heldout").prompt("t2i", 0)
    assert gens[0].split == "train" and gens[0].prompt == world.prompt("t2i", 0)
    # one-shape flags: one per t2i image and edit output, one per predicted keyframe
    kf_first = [g for g in gens if g.task == "keyframes" and g.keyframe_given == "first"]
    assert all(len(g.one_shape) == 2 for g in kf_first)
    assert all(len(g.one_shape) == 1 for g in gens if g.task != "keyframes")


def test_evaluate_counts_ghosts_and_second_shapes(oracle) -> None:
    def spoil(task, frames, meta):
        if task == "edit":   # leave a faint copy of the source behind
            frames[0] = blend(frames[0], meta["spec"].source, 0.3)
        elif task == "t2i" and meta["index"] % 2 == 0:  # every other image gets a second shape
            spec = meta["spec"]
            cell = CELLS[(CELLS.index((spec.row, spec.col)) + 4) % 9]
            frames[0] = blend(frames[0], replace(spec, row=cell[0], col=cell[1], dx=0.0, dy=0.0), 1.0)
        return frames

    world = ShapesWorld(12345, size=48, frames=3, motion="across")
    metrics, gens = evaluate(_Oracle(spoil), world, 8, steps=2, cfg_scale=1.0, tasks=("t2i", "edit"))
    assert metrics["t2i_color_acc"] == metrics["t2i_shape_acc"] == metrics["t2i_acc"] == 0.5
    assert metrics["heldout_t2i_position_acc"] == 0.5
    visible = [g for g in gens if g.task == "edit" and not g.score["one_shape"]]
    assert metrics["edit_acc"] <= 0.5 and len(visible) >= 8  # most edits leave a visible ghost
    assert metrics["one_shape_rate"] < 0.5 and metrics["heldout_one_shape_rate"] < 0.5
    assert metrics["keyframe_acc"] is None and metrics["keyframe_acc_first"] is None


def test_edits_are_also_scored_by_kind(oracle) -> None:
    def spoil(task, frames, meta):
        if task == "edit" and meta["spec"].kind == "position":   # a move not done: the source itself
            frames[0] = meta["source"]
        return frames

    world = ShapesWorld(12345, size=48, frames=3, motion="across")
    metrics, gens = evaluate(_Oracle(spoil), world, 24, steps=2, cfg_scale=1.0, tasks=("edit",))
    for prefix in ("", "heldout_"):
        edits = [g for g in gens if g.task == "edit" and g.split == ("heldout" if prefix else "train")]
        kinds = [g.edit_kind for g in edits]
        assert set(kinds) == {"color", "position", "shape", "size"}
        assert metrics[prefix + "edit_position_acc"] == 0.0
        assert all(metrics[f"{prefix}edit_{k}_acc"] == 1.0 for k in ("color", "shape", "size"))
        assert metrics[prefix + "edit_acc"] == round(1 - kinds.count("position") / len(kinds), 4)


def test_generate_task_keeps_its_positional_signature(oracle) -> None:
    world = ShapesWorld(7, size=32, frames=3)
    gens = generate_task(_Oracle(), world, "keyframes", [0, 1], 2, 1.0, 0, "first")
    assert [g.score["ok"] for g in gens] == [True, True] and gens[0].keyframe_given == "first"
    assert len(gens[0].images) == 3 and gens[0].split == "train"
    with pytest.raises(ValueError, match="keyframe_given"):
        evaluate(_Oracle(), world, 1, 2, 1.0, keyframe_given="last")


def test_background_shade_reads_the_grey_behind_the_shape_from_pixels():
    """The rater of bench/dpo_shapes.py: the background's grey from the image alone, whatever shape sits on it
    (a big shape touching the border included); a gradient reads as its mean."""
    from difftrain.shapes.evaluate import background_shade
    from difftrain.shapes.world import render_at

    for bg in (100, 131, 160):
        for shape, color, size, cx, cy in (("circle", "red", "small", 8, 8), ("square", "blue", "large", 24, 24),
                                           ("triangle", "yellow", "large", 40, 40)):
            img = render_at(shape, color, size, cx, cy, bg, 48)
            assert abs(background_shade(img) - bg) < 1.0, (bg, shape)
    ramp = np.repeat(np.linspace(100, 160, 48, dtype=np.float32)[None, :, None], 48, 0).repeat(3, 2).astype(np.uint8)
    assert abs(background_shade(ramp) - 130) < 1.5
