"""Text-to-image accuracy of a run at several canvas sizes: the shapes world's prompts (``eval.seed``) generated at
each H x W (48 x 48 first), the centre square cropped (the exported world puts its scene there) and read by the
shapes evaluator. Prints one JSON object: per size, colour / position / shape accuracy. A diagnostic for
training over aspect buckets; ``difftrain eval`` remains the full evaluation (all tasks, held-out prompts).

    python bench/bucket_probe.py RUN_OR_CHECKPOINT [--n 64] [48x64 64x48 ...]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from difftrain.inference import load_pipeline
from difftrain.shapes import world_from_config
from difftrain.shapes.evaluate import score_t2i


def probe(pipe, cfg, n: int, sizes: list[tuple[int, int]]) -> dict:
    world = world_from_config(cfg.data, cfg.eval.seed)
    examples = [world.t2i(i) for i in range(n)]
    prompts, specs = [e[1] for e in examples], [e[2] for e in examples]
    side = cfg.data.image_size
    out = {}
    for h, w in sizes:
        batch = pipe.blank_batch(prompts, h, w)
        imgs = pipe.to_images(pipe.sample(batch, cfg.sample.steps, 1.0, seed=cfg.sample.seed))
        oy, ox = (h - side) // 2, (w - side) // 2
        scores = [score_t2i(imgs[i, 0][oy:oy + side, ox:ox + side], specs[i]) for i in range(n)]
        out[f"{h}x{w}"] = {k: round(float(np.mean([bool(s[k]) for s in scores])), 3)
                           for k in ("color", "position", "shape")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("sizes", nargs="*", help="H x W canvases besides data.image_size squared, e.g. 48x64")
    ap.add_argument("--n", type=int, default=64)
    args = ap.parse_args()
    pipe, cfg, _ = load_pipeline(args.checkpoint)
    side = cfg.data.image_size
    sizes = [(side, side)] + [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes]
    if any(h < side or w < side for h, w in sizes):
        ap.error(f"every size must hold the {side} x {side} scene (data.image_size)")
    print(json.dumps(probe(pipe, cfg, args.n, sizes)))


if __name__ == "__main__":
    main()
