"""Automatic raters: scripted people that answer through the rating app's HTTP API (``--rater auto:NAME[:POLICY]``).

A **measure** reads, from pixels alone, an attribute the shapes world's captions leave free (``MEASURES``):
- ``light``: the background's shade (``shapes.evaluate.background_shade``: the grey of the plane fitted to the
  image's border);
- ``left`` / ``high``: how far left / up the shape sits inside its cell (``shapes.evaluate.jitter``, as a share of
  the largest offset the world draws for its size; an image without a readable shape measures lowest).
A measure suffixed ``+caption`` (``light+caption``, ...) also reads the caption, as a person does before anything
else: an image that does not show what its text-to-image caption asks (``shapes.evaluate.score_t2i``: colour,
position, shape and size) ranks below every image that does, and among such images the measure still orders; on a
pairwise item where neither image shows it the answer is "both bad". Without the suffix the caption is not read.
A **policy** orders an item's candidates by one (the images fetched from the app, as a browser would):
- ``MEASURE`` (``light``, ``left``, ``high``, each optionally ``+caption``): an honest rater, the highest first;
  on a pairwise item two candidates closer than the measure's just-noticeable difference (``JND``) are answered as
  a tie;
- ``noisy-MEASURE``: the same, but one answer in five a random order (an honest, careless person); ``noisy`` is
  ``noisy-light``;
- ``random``: a random order every time (a spammer; gold items give them away).
Measures also give gold items their known order (``difftrain align --gold-measure``), and the preference benchmark
its score: the share of samples in the preferred quarter of the attribute's range (``preferred``).
"""

from __future__ import annotations

import io
import random
import threading

import numpy as np

from difftrain.errors import UserError

NOT_READ = -1e9          # the measure of an image whose shape cannot be read: below every real one
UNFAITHFUL = -1e6        # added to the measure of an image that does not show its caption (+caption measures)
CAPTION = "+caption"


def light(image_rgb: np.ndarray) -> float:
    from difftrain.shapes.evaluate import background_shade

    return float(background_shade(image_rgb))


def _offset(image_rgb: np.ndarray, axis: int) -> float:
    from difftrain.shapes.evaluate import jitter

    j = jitter(image_rgb)
    return NOT_READ if j is None else -float(j[axis])


def left(image_rgb: np.ndarray) -> float:
    return _offset(image_rgb, 0)


def high(image_rgb: np.ndarray) -> float:
    return _offset(image_rgb, 1)


MEASURES = {"light": light, "left": left, "high": high}
# Differences a person does not see: 3 grey levels of a background; 15% of the jitter range (about half a pixel
# for a small shape at 48 px).
JND = {"light": 3.0, "left": 0.15, "high": 0.15}
READS = (*MEASURES, *(m + CAPTION for m in MEASURES))       # what a rater or gold may read
POLICIES = (*READS, *(f"noisy-{m}" for m in READS), "noisy", "random")


def base_measure(name: str) -> str:
    """``high+caption`` -> ``high``; an unknown name is a UserError naming it."""
    base = name[:-len(CAPTION)] if name.endswith(CAPTION) else name
    if base not in MEASURES:
        raise UserError(f"measure {name!r}: expected one of {READS}")
    return base


def read(name: str, image_rgb: np.ndarray, caption: str | None = None, task: str = "t2i") -> float:
    """What a rater (or gold) reading ``name`` makes of an image: its measure, lowered below every faithful image
    when the name reads the caption and the image does not show it (text-to-image captions only)."""
    from difftrain.shapes.evaluate import score_t2i

    value = MEASURES[base_measure(name)](image_rgb)
    if name.endswith(CAPTION) and caption and task == "t2i" and value > NOT_READ:
        try:
            ok = score_t2i(image_rgb, caption)["ok"]
        except (UserError, ValueError, KeyError):
            ok = True                    # a caption the world cannot parse asks for nothing the rater can check
        if not ok:
            value += UNFAITHFUL
    return value


def unfaithful(value: float) -> bool:
    return value < UNFAITHFUL / 2


def preferred(measure: str, value: float, background: tuple[int, int] = (100, 160)) -> bool:
    """Whether a measured value lies in the preferred quarter of its attribute's range: a shade in the lightest
    quarter of ``background`` (``data.background``), a shape in the leftmost / highest quarter of its jitter."""
    if measure == "light":
        lo, hi = background
        return value >= hi - (hi - lo) / 4
    if measure in ("left", "high"):
        return value >= 0.5
    raise UserError(f"measure {measure!r}: expected one of {sorted(MEASURES)}")


def parse_rater(spec: str) -> tuple[str, str]:
    """``auto:NAME[:POLICY]`` -> (name, policy)."""
    parts = spec.split(":")
    if parts[0] != "auto" or len(parts) not in (2, 3) or not parts[1]:
        raise UserError(f"--rater {spec!r}: expected auto:NAME or auto:NAME:POLICY ({', '.join(POLICIES)})")
    policy = parts[2] if len(parts) == 3 else "light"
    if policy not in POLICIES:
        raise UserError(f"--rater {spec!r}: policy {policy!r}, expected one of {POLICIES}")
    return parts[1], policy


def split_policy(policy: str) -> tuple[str, str | None]:
    """A policy -> (kind: honest, noisy or random; its measure, None for random)."""
    if policy == "random":
        return "random", None
    if policy == "noisy":
        return "noisy", "light"
    if policy.startswith("noisy-"):
        return "noisy", policy[len("noisy-"):]
    return "honest", policy


def decide(scores: dict[str, float], measure: str, rng: random.Random, kind: str) -> tuple[list, str]:
    """(order, outcome) for an item whose candidates (by handle) measure ``scores``."""
    handles = list(scores)
    if kind == "random" or (kind == "noisy" and rng.random() < 0.2):
        return rng.sample(handles, len(handles)), "ranked"
    if len(handles) == 2 and all(unfaithful(scores[h]) for h in handles):
        return [], "both_bad"
    if len(handles) == 2 and abs(scores[handles[0]] - scores[handles[1]]) < JND[base_measure(measure)]:
        return [], "tie"
    return sorted(handles, key=lambda h: -scores[h]), "ranked"


def _decode(png: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        return np.asarray(im.convert("RGB"))


def answer_all(url: str, token: str, policy: str, seed: int, stop: threading.Event | None = None) -> int:
    """Answer items until none is left for this rater; the number answered."""
    from difftrain_rate.client import RaterClient

    kind, measure = split_policy(policy)
    rng, n = random.Random(seed), 0
    client = RaterClient(url, token)
    try:
        while stop is None or not stop.is_set():
            item = client.next()
            if item is None:
                return n
            handles = [c["handle"] for c in item["candidates"]]
            if kind == "random":
                scores = dict.fromkeys(handles, 0.0)
            else:
                scores = {c["handle"]: read(measure, _decode(client.image(c["frames"][0])), item.get("prompt"),
                                            item.get("task", "t2i"))
                          for c in item["candidates"]}
            order, outcome = decide(scores, measure or "light", rng, kind)
            client.answer(item, order, outcome, key=f"{seed}-{item['assignment']}")
            n += 1
        return n
    finally:
        client.close()
