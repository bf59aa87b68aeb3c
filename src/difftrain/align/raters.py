"""Automatic raters: scripted people that answer through the rating app's HTTP API (``--rater auto:NAME[:POLICY]``).

A policy orders an item's candidates from their pixels (the images fetched from the app, as a browser would):
- ``light``: a lighter background first (``shapes.evaluate.background_shade``: the grey of the background plane
  fitted to the image's border), the preference the shapes world's captions leave free;
- ``noisy``: ``light``, but one answer in five a random order (an honest, careless person);
- ``random``: a random order every time (a spammer; gold items give them away).
Measures (``MEASURES``) also give gold items their known order (``difftrain align --gold-measure``).
"""

from __future__ import annotations

import io
import random
import threading

import numpy as np

from difftrain.errors import UserError


def light(image_rgb: np.ndarray) -> float:
    from difftrain.shapes.evaluate import background_shade

    return float(background_shade(image_rgb))


MEASURES = {"light": light}
POLICIES = ("light", "noisy", "random")


def parse_rater(spec: str) -> tuple[str, str]:
    """``auto:NAME[:POLICY]`` -> (name, policy)."""
    parts = spec.split(":")
    if parts[0] != "auto" or len(parts) not in (2, 3) or not parts[1]:
        raise UserError(f"--rater {spec!r}: expected auto:NAME or auto:NAME:POLICY ({', '.join(POLICIES)})")
    policy = parts[2] if len(parts) == 3 else "light"
    if policy not in POLICIES:
        raise UserError(f"--rater {spec!r}: policy {policy!r}, expected one of {POLICIES}")
    return parts[1], policy


def _decode(png: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        return np.asarray(im.convert("RGB"))


def answer_all(url: str, token: str, policy: str, seed: int, stop: threading.Event | None = None) -> int:
    """Answer items until none is left for this rater; the number answered."""
    from difftrain_rate.client import RaterClient

    rng, n = random.Random(seed), 0
    client = RaterClient(url, token)
    try:
        while stop is None or not stop.is_set():
            item = client.next()
            if item is None:
                return n
            handles = [c["handle"] for c in item["candidates"]]
            if policy == "random" or (policy == "noisy" and rng.random() < 0.2):
                order = rng.sample(handles, len(handles))
            else:
                score = {c["handle"]: light(_decode(client.image(c["frames"][0]))) for c in item["candidates"]}
                order = sorted(handles, key=lambda h: -score[h])
            client.answer(item, order, key=f"{seed}-{item['assignment']}")
            n += 1
        return n
    finally:
        client.close()
