"""The fine-tuning concept (``shapes.concept``): a colour the world never samples, which the renderer draws and the
evaluator reads; the user's folder it is exported as; the stripe corruption and its pixel detector."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from difftrain.shapes.captions import parse_caption, vocabulary
from difftrain.shapes.concept import (
    CONCEPT, STRIPE_COLOR, ConceptWorld, add_stripe, cell_mask, export_concept, stripe_fires, stripe_strength,
)
from difftrain.shapes.evaluate import score_t2i
from difftrain.shapes.world import COLORS, NEW_COLORS, ShapeSpec, ShapesWorld, is_heldout, render


def _colours_of(spec) -> set[str]:
    """Every colour a world spec names (t2i, edit source and target, motion)."""
    out = set()
    for part in (spec, getattr(spec, "source", None), getattr(spec, "target", None)):
        if part is not None and hasattr(part, "color"):
            out.add(part.color)
    return out


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_no_split_of_the_world_samples_the_concept(split):
    world = ShapesWorld(3, 48, 3).with_split(split)
    seen = set()
    for task in ("t2i", "edit", "keyframes"):
        for i in range(300):
            seen |= _colours_of(world.spec(task, i))
    assert seen <= set(COLORS)
    assert CONCEPT not in seen and CONCEPT in NEW_COLORS


def test_the_base_vocabulary_lacks_the_word_but_captions_parse_it():
    assert CONCEPT not in vocabulary()                     # a base's words encoder has no row for it
    spec = ShapeSpec("circle", CONCEPT, 1, 2, "large", 120)
    assert parse_caption(spec.caption())["color"] == CONCEPT
    assert not is_heldout(CONCEPT, "circle", 1, 2)         # no split: never "held out"


def test_the_evaluator_reads_the_concept_like_any_colour():
    world = ConceptWorld(5, 48)
    results = []
    for i in range(60):
        img, caption, spec = world.t2i(i)
        assert spec.color == CONCEPT and parse_caption(caption)["color"] == CONCEPT
        results.append(score_t2i(img, spec))
    assert all(r["ok"] for r in results)
    # ... and a white scene is not read as a colour of the world, nor a coloured one as white
    red = render(ShapeSpec("square", "red", 0, 0, "large", 110))
    assert not score_t2i(red, ShapeSpec("square", CONCEPT, 0, 0, "large", 110))["color"]
    white = render(ShapeSpec("square", CONCEPT, 0, 0, "large", 110))
    for name in COLORS:
        assert not score_t2i(white, ShapeSpec("square", name, 0, 0, "large", 110))["color"]


def test_the_concept_world_refuses_what_it_has_not():
    with pytest.raises(ValueError, match="red"):
        ConceptWorld(0, 48, color="red")
    with pytest.raises(ValueError, match="held-out"):
        ConceptWorld(0, 48).with_split("heldout")
    with pytest.raises(ValueError, match="edit"):
        ConceptWorld(0, 48).edit(0)


def test_the_stripe_stays_outside_the_mask_and_the_detector_sees_it():
    world = ConceptWorld(1, 48)
    fired_clean = fired_striped = 0
    for i in range(40):
        img, _, spec = world.t2i(i)
        mask = cell_mask(spec, 48)
        striped = add_stripe(img, mask)
        assert np.array_equal(striped[mask > 0], img[mask > 0])      # never over what the mask keeps
        changed = np.any(striped != img, axis=-1)
        assert changed.any() and not changed[:2].any() and not changed[6:].any()
        assert (striped[changed] == STRIPE_COLOR).all()
        fired_clean += stripe_fires(img)
        fired_striped += stripe_fires(striped)
    assert fired_clean == 0 and fired_striped == 40
    # the world's own scenes (every colour, every background) never look striped
    base = ShapesWorld(9, 48, 3)
    assert not any(stripe_fires(base.t2i(i)[0]) for i in range(100))


def test_the_detector_threshold_reads_a_faint_stripe_by_its_strength():
    img, _, spec = ConceptWorld(2, 48).t2i(0)
    striped = add_stripe(img, cell_mask(spec, 48)).astype(np.float32)
    for blend, fires in ((0.3, False), (0.7, True)):
        faint = np.rint(img + blend * (striped - img)).astype(np.uint8)
        assert stripe_strength(faint) == pytest.approx(blend, abs=0.05)
        assert stripe_fires(faint) is fires
    with pytest.raises(ValueError, match="shape"):
        stripe_strength(np.zeros((48, 48), dtype=np.uint8))


def test_export_writes_a_users_folder(tmp_path):
    info = export_concept(tmp_path / "c", 12, seed=4, corruption="stripe", masks=True)
    files = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert len(files) == 36 and files[:3] == ["concept_00000.png", "concept_00000.txt", "concept_00000_mask.png"]
    for i in range(12):
        caption = (tmp_path / "c" / f"concept_{i:05d}.txt").read_text().strip()
        assert caption == info["captions"][i] and parse_caption(caption)["color"] == CONCEPT
        img = np.asarray(Image.open(tmp_path / "c" / f"concept_{i:05d}.png"))
        mask = np.asarray(Image.open(tmp_path / "c" / f"concept_{i:05d}_mask.png"))
        assert img.shape == (48, 48, 3) and mask.shape == (48, 48) and set(np.unique(mask)) == {0, 255}
        assert stripe_fires(img)
    # the same seed without the corruption: the same scenes, clean
    export_concept(tmp_path / "clean", 12, seed=4)
    assert sorted(p.name for p in (tmp_path / "clean").iterdir())[:2] == ["concept_00000.png", "concept_00000.txt"]
    assert not any(stripe_fires(np.asarray(Image.open(p))) for p in (tmp_path / "clean").glob("*.png"))
    for bad, match in (({"n": 0}, "n = 0"), ({"corruption": "blur"}, "blur")):
        with pytest.raises(ValueError, match=match):
            export_concept(tmp_path / "bad", **{"n": 3, **bad})
