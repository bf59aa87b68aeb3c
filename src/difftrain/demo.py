"""``difftrain demo``: the shapes world end to end on this machine: generate, train, sample, evaluate."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from difftrain.config import load_config
from difftrain.shapes import world_from_config
from difftrain.shapes.world import ShapesWorld
from difftrain.shapes.evaluate import score_t2i
from difftrain.evaluate import EVAL_KEYS, evaluate
from difftrain.images import caption_grid
from difftrain.inference import guidance_scale
from difftrain.progress import run_training
from difftrain.train import build_trainer

log = logging.getLogger("difftrain.demo")


def preview_world(world: ShapesWorld, path: Path, n: int = 6) -> float:
    """A grid of ground-truth examples of each task, and the evaluator's accuracy on 200 of them."""
    rows = []
    for i in range(n):
        img, caption, _ = world.t2i(i)
        rows.append(([img], caption))
    for i in range(n // 2):
        src, tgt, instruction, _ = world.edit(i)
        rows.append(([src, tgt], instruction))
    for i in range(n // 2):
        frames, caption, _ = world.keyframes(i)
        rows.append((list(frames), caption))
    caption_grid(rows, path)
    scores = [score_t2i(*world.t2i(10_000 + i)[::2]) for i in range(200)]
    return float(np.mean([all(s.values()) for s in scores]))


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels dispatch to here ("AVX2", "AVX512", ...): with the torch build and the
    thread count, what decides the rounding of every step, hence the weights a fixed step count trains."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):                   # a build without the query
        return "unknown"


def probe_gflops(seconds: float = 0.5, n: int = 512) -> float:
    """A fixed CPU speed probe: float32 GFLOP/s of an n x n matmul, repeated for about ``seconds`` (the median of
    its runs), on this process's threads. Figures from different days compare only beside it."""
    import statistics

    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    times, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 5:
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return round(2 * n ** 3 / statistics.median(times) / 1e9, 2)


def weights_digest(tensors: dict) -> str:
    """sha256 over the named tensors' bytes in name order: two machines that trained the same model show the same."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(name.encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_demo(config: Path, out: Path, minutes: float | None, overrides: list[str], progress: bool = True) -> dict:
    # --minutes: a time budget in place of the recipe's fixed steps (the step cap lifted unless --set names one)
    sets = (["train.steps=1000000"] + list(overrides) + [f"train.minutes={minutes}"] if minutes is not None
            else list(overrides))
    cfg = load_config(config, sets)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    if (run_dir / "config.toml").is_file():        # a previous demo's run: the demo always starts fresh
        log.info("removing the previous demo run in %s", run_dir)
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    world = world_from_config(cfg.data, cfg.run.seed)
    gt_acc = preview_world(world, out / "world.png")
    log.info("shapes world: %dx%d images, %d frames per sequence; ground-truth evaluator accuracy %.3f; "
             "preview in %s", cfg.data.image_size, cfg.data.image_size, cfg.data.frames, gt_acc, out / "world.png")

    cfg_scale = guidance_scale(cfg, None)           # warned about before training, not after
    if cfg.train.threads:                           # the probe runs on the threads training will use
        torch.set_num_threads(cfg.train.threads)
    probe = probe_gflops()
    log.info("CPU speed probe: %.1f GFLOP/s (a 512x512 float32 matmul on %d threads)", probe, torch.get_num_threads())
    trainer = build_trainer(cfg, run_dir)
    n_params = sum(p.numel() for p in trainer.model.parameters()) / 1e6
    if cfg.train.minutes:
        log.info("model: %.2fM parameters; training to a time budget of %s min: the step count, and with it the "
                 "model, follows this machine's speed", n_params, cfg.train.minutes)
    else:
        log.info("model: %.2fM parameters; training %d steps (a fixed count: the same model on any machine with "
                 "this torch build, %d threads and a CPU of this instruction set, %s); an estimate of the time "
                 "follows the first steps", n_params, cfg.train.steps, torch.get_num_threads(), cpu_capability())
    summary = run_training(cfg, run_dir, progress, trainer)

    log.info("evaluating %d prompts per task", cfg.eval.n)
    t_eval = time.perf_counter()
    pipe = trainer.pipeline()
    with trainer.ema.applied(trainer.model) if trainer.ema else contextlib.nullcontext():
        trainer.model.eval()
        metrics, gens = evaluate(pipe, world_from_config(cfg.data, cfg.eval.seed), cfg.eval.n, cfg.sample.steps,
                                 cfg_scale, cfg.sample.seed, cfg.eval.keyframe_given)
    eval_seconds = time.perf_counter() - t_eval
    by_task: dict[str, list] = {}
    for g in gens:
        by_task.setdefault(g.task, []).append(g)
    rows = [(g.images, g.prompt) for task in ("t2i", "edit", "keyframes") for g in by_task.get(task, [])[:8]]
    grid = caption_grid(rows, out / "samples.png")
    # seen and held-out (heldout_*) accuracies, keyframes with none/first frame given, one_shape_rate
    result = {**{k: metrics[k] for k in ("t2i_color_acc", "t2i_position_acc", "t2i_shape_acc", "edit_acc",
                                         "keyframe_acc")},
              "t2i_size_acc": metrics["t2i_size_acc"], "n": metrics["n"],
              **{k: metrics[k] for k in EVAL_KEYS if k not in ("n",)},
              "train_seconds": summary["train_seconds"], "steps": summary["steps"],
              # what makes two runs comparable: the same steps, threads, torch build and CPU instruction set (the
              # kernels torch dispatches to: AVX2 and AVX-512 machines round differently) train the same weights
              "budget": (f"time: {cfg.train.minutes} min (steps follow the machine's speed)" if cfg.train.minutes
                         else f"steps: {cfg.train.steps}"),
              "s_per_step": round(summary["train_seconds"] / max(1, summary["steps"]), 4),
              "estimate_s_per_step": summary.get("estimate", {}).get("s_per_step"),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu_capability": cpu_capability(),
              "probe_gflops": probe,
              "weights_sha256": weights_digest(trainer.ema.state_dict() if trainer.ema else
                                               dict(trainer.model.named_parameters())),
              "eval_seconds": round(eval_seconds, 1), "total_seconds": round(time.perf_counter() - t0, 1),
              "num_params": summary["num_params"], "ground_truth_acc": round(gt_acc, 4),
              "samples_png": str(grid), "run_dir": str(run_dir)}
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    return result
