"""Where the demo's step time goes, and what two of its savings buy, measured in one process on the same steps.

The demo's trainer (``shapes-tiny``) is built once. ``data_ms`` is the shapes loader alone building a step (render,
pack, tokenize). Then the same ``--steps`` steps (the loader rewound to the same state each time, so every
configuration trains on the same data) run in turns, ``--rounds`` times, under four configurations: ``full`` (every
block over every row, the next step built when it is asked for), ``pruned`` (the last block's text rows skip their
MLP and output projection), ``prefetch`` (the next step built in a thread during the backward pass) and ``both`` (what
the trainer does). Taking turns puts a shared machine's drift into every configuration alike. Prints one JSON object:
the median seconds a step of each, and each one's time over ``full``'s.

    python bench/demo_step.py [--threads 2] [--steps 20] [--rounds 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def full_blocks():
    """The single blocks' forward without the last block's pruning: every row computed, the text rows dropped after (a
    double-only model's last block is pruned by construction: `context_pre_only`)."""
    from difftrain.models.layers import SingleStreamBlock

    single = SingleStreamBlock.forward

    def single_full(self, x, vec, rope, mask=None, keep_from=0):
        return single(self, x, vec, rope, mask)[:, keep_from:]

    def apply(on: bool) -> None:
        SingleStreamBlock.forward = single_full if on else single

    return apply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--config", default="shapes-tiny")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from difftrain.config import load_config, preset_path
    from difftrain.train import build_trainer

    cfg = load_config(preset_path(args.config), [f"train.threads={args.threads}", "train.checkpoint_every=0",
                                                  "train.log_every=100000"])
    trainer = build_trainer(cfg, Path(tempfile.mkdtemp(prefix="demo-step-")) / "run")
    loader = trainer.loader
    prefetch = loader.prefetch                            # (the trainer itself builds ahead only off a CPU)
    for _ in range(10):                                   # warm-up: kernels, allocator, the first steps' costs
        trainer.train_step(next(loader))
    start = loader.state_dict()

    t0 = time.perf_counter()
    for _ in range(args.steps * 3):
        next(loader)
    data_ms = (time.perf_counter() - t0) / (args.steps * 3) * 1e3

    set_full = full_blocks()
    configs = {"full": (True, False), "pruned": (False, False), "prefetch": (True, True), "both": (False, True)}
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, (full, ahead) in configs.items():
            set_full(full)
            trainer.prefetch = prefetch if ahead else None
            loader.load_state_dict(start)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step(next(loader))
            times[name].append((time.perf_counter() - t0) / args.steps)
    set_full(False)
    med = {name: statistics.median(v) for name, v in times.items()}
    print(json.dumps({
        "config": args.config, "threads": args.threads, "steps": args.steps, "rounds": args.rounds,
        "torch": torch.__version__, "data_ms": round(data_ms, 2),
        **{f"s_per_step_{n}": round(v, 4) for n, v in med.items()},
        **{f"ratio_{n}": round(v / med["full"], 3) for n, v in med.items() if n != "full"},
        "rounds_s_per_step": {n: [round(x, 4) for x in v] for n, v in times.items()},
    }))


if __name__ == "__main__":
    main()
