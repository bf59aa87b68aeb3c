"""The scripted raters' measures and answers (``difftrain.align.raters``) and the free attributes they read from
pixels: the shape's jitter read back against the world's ground truth, the preferred quarter of each attribute,
ties below a just-noticeable difference, noisy and random raters."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from difftrain.align.raters import JND, MEASURES, NOT_READ, decide, parse_rater, preferred, split_policy
from difftrain.errors import UserError
from difftrain.shapes.evaluate import jitter
from difftrain.shapes.world import max_jitter, render, sample_shape


def test_jitter_is_read_back_from_pixels_against_the_worlds_offsets():
    rng = np.random.default_rng(3)
    truth, read = [], []
    for _ in range(150):
        spec = sample_shape(rng, (100, 160))
        lim = max_jitter(spec.size)
        got = jitter(render(spec, 48))
        assert got is not None, spec
        truth.append((spec.dx / lim, spec.dy / lim))
        read.append(got)
    truth, read = np.array(truth), np.array(read)
    assert np.abs(truth - read).max() < 0.1                       # a tenth of the range at worst
    for axis in (0, 1):
        assert np.corrcoef(truth[:, axis], read[:, axis])[0, 1] > 0.99
    # the measures: further left / higher measures more; a blank image has no shape to read
    spec = sample_shape(np.random.default_rng(0))
    lim = max_jitter(spec.size)
    far_left = render(dataclasses.replace(spec, dx=-lim, dy=lim), 48)
    far_right = render(dataclasses.replace(spec, dx=lim, dy=-lim), 48)
    assert MEASURES["left"](far_left) > 0.8 > -0.8 > MEASURES["left"](far_right)
    assert MEASURES["high"](far_right) > 0.8 > -0.8 > MEASURES["high"](far_left)
    blank = np.full((48, 48, 3), 130, np.uint8)
    assert jitter(blank) is None and MEASURES["left"](blank) == NOT_READ
    assert MEASURES["light"](blank) == pytest.approx(130, abs=0.5)


def test_the_preferred_quarter_of_each_attribute():
    assert preferred("light", 145.0, (100, 160)) and not preferred("light", 144.9, (100, 160))
    assert preferred("light", 60.0, (20, 60)) and not preferred("light", 49.0, (20, 60))
    assert preferred("left", 0.5) and not preferred("left", 0.49) and not preferred("high", NOT_READ)
    with pytest.raises(UserError, match="measure 'dark'"):
        preferred("dark", 1.0)


def test_honest_noisy_and_random_answers():
    rng = random.Random(0)
    assert decide({"a": 0.1, "b": 0.9, "c": 0.5}, "left", rng, "honest") == (["b", "c", "a"], "ranked")
    # a pair closer than the just-noticeable difference is a tie; a ranking orders every candidate still
    assert decide({"a": 0.0, "b": JND["left"] * 0.9}, "left", rng, "honest") == ([], "tie")
    assert decide({"a": 0.0, "b": JND["left"] * 1.1}, "left", rng, "honest") == (["b", "a"], "ranked")
    assert decide({"a": 120.0, "b": 121.0}, "light", rng, "honest") == ([], "tie")
    assert decide({"a": 0.0, "b": 0.01, "c": 0.02}, "left", rng, "honest")[1] == "ranked"
    scores = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    honest = ["d", "c", "b", "a"]
    noisy = [decide(scores, "high", rng, "noisy")[0] for _ in range(2000)]
    wrong = sum(o != honest for o in noisy) / len(noisy)
    assert 0.15 < wrong < 0.22                        # one answer in five at random (1 in 24 of those honest)
    spam = [tuple(decide(scores, "high", rng, "random")[0]) for _ in range(2400)]
    assert len(set(spam)) == 24 and max(spam.count(o) for o in set(spam)) < 170     # every order, evenly


def test_rater_specs_name_a_known_policy():
    assert parse_rater("auto:ann") == ("ann", "light")
    assert parse_rater("auto:ben:noisy-high") == ("ben", "noisy-high")
    assert split_policy("noisy") == ("noisy", "light") and split_policy("noisy-left") == ("noisy", "left")
    assert split_policy("random") == ("random", None) and split_policy("high") == ("honest", "high")
    for bad in ("auto:x:dark", "ann", "auto::light", "auto:x:noisy-dark"):
        with pytest.raises(UserError, match="--rater"):
            parse_rater(bad)


def test_a_rater_reading_the_caption_puts_an_image_that_does_not_show_it_last():
    """``+caption``: the caption first, as a person reads it. An image of another colour, shape or place than its
    caption asks ranks below every faithful one (the measure still orders the unfaithful among themselves); a pair
    where neither shows the caption is "both bad"; without the suffix the caption is not read."""
    import dataclasses

    from difftrain.align.raters import base_measure, read, unfaithful

    spec = sample_shape(np.random.default_rng(5), (100, 160))
    lim = max_jitter(spec.size)
    high_img = render(dataclasses.replace(spec, dy=-lim), 48)
    low_img = render(dataclasses.replace(spec, dy=lim), 48)
    other = next(c for c in ("red", "green", "blue", "yellow") if c != spec.color)
    wrong_high = render(dataclasses.replace(spec, color=other, dy=-lim), 48)
    wrong_low = render(dataclasses.replace(spec, color=other, dy=lim), 48)
    cap = spec.caption()
    assert read("high", wrong_high, cap) == MEASURES["high"](wrong_high)          # pixels only: caption unread
    faithful = {"a": read("high+caption", high_img, cap), "b": read("high+caption", low_img, cap)}
    assert faithful == {"a": MEASURES["high"](high_img), "b": MEASURES["high"](low_img)}
    scores = {**faithful, "c": read("high+caption", wrong_high, cap), "d": read("high+caption", wrong_low, cap)}
    assert unfaithful(scores["c"]) and unfaithful(scores["d"]) and not unfaithful(scores["b"])
    rng = random.Random(0)
    assert decide(scores, "high+caption", rng, "honest") == (["a", "b", "c", "d"], "ranked")
    assert decide({"c": scores["c"], "d": scores["d"]}, "high+caption", rng, "honest") == ([], "both_bad")
    assert decide({"a": scores["a"], "c": scores["c"]}, "high+caption", rng, "honest") == (["a", "c"], "ranked")
    # not a text-to-image caption (an edit instruction), or one the world cannot parse: nothing to check
    assert read("high+caption", wrong_high, "make it bigger", task="edit") == MEASURES["high"](wrong_high)
    assert read("high+caption", wrong_high, "a purple dog") == MEASURES["high"](wrong_high)
    assert parse_rater("auto:ann:noisy-high+caption") == ("ann", "noisy-high+caption")
    assert split_policy("noisy-left+caption") == ("noisy", "left+caption")
    assert base_measure("light+caption") == "light"
    for bad in ("auto:x:high+cap", "auto:x:+caption"):
        with pytest.raises(UserError, match="--rater"):
            parse_rater(bad)
    with pytest.raises(UserError, match="'dark\\+caption'"):
        base_measure("dark+caption")
