"""Evaluate a model on the shapes world: generate for N prompts per task, read the images back with
the shapes evaluator, report accuracies. Used by ``difftrain eval``, ``demo`` and training."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from difftrain.data.shapes import ShapesWorld
from difftrain.data.shapes_eval import score_edit, score_keyframes, score_t2i
from difftrain.data.shapes_loader import make_batch
from difftrain.diffusion.pipeline import Pipeline

EVAL_KEYS = ("t2i_color_acc", "t2i_position_acc", "t2i_shape_acc", "edit_acc", "keyframe_acc", "n")


@dataclass
class Generated:
    task: str
    prompt: str
    images: list[np.ndarray]          # what to show: (reference,) generated frame(s)
    score: dict


def generate_task(pipe: Pipeline, world: ShapesWorld, task: str, indices: list[int], steps: int, cfg_scale: float,
                  seed: int, keyframe_given: str = "first", batch_size: int = 32) -> list[Generated]:
    out: list[Generated] = []
    for lo in range(0, len(indices), batch_size):
        chunk = indices[lo:lo + batch_size]
        targets = None
        if task == "keyframes":
            k = world.frames
            targets = [[f != 0 if keyframe_given == "first" else True for f in range(k)] for _ in chunk]
        batch = make_batch(world, pipe.autoencoder, pipe.text_encoder.tokenize, task, chunk, targets)
        imgs = pipe.to_images(pipe.sample(batch, steps, cfg_scale, seed=seed + lo))
        for b, m in enumerate(batch.meta):
            if task == "t2i":
                out.append(Generated(task, batch.prompts[b], [imgs[b, 0]], score_t2i(imgs[b, 0], m["spec"])))
            elif task == "edit":
                s = score_edit(imgs[b, 0], m["spec"], m["source"])
                out.append(Generated(task, batch.prompts[b], [m["source"], imgs[b, 0]], s))
            else:
                s = score_keyframes(imgs[b], m["spec"])
                out.append(Generated(task, batch.prompts[b], list(imgs[b]), s))
    return out


def evaluate(pipe: Pipeline, world: ShapesWorld, n: int, steps: int, cfg_scale: float, sample_seed: int = 0,
             keyframe_given: str = "first", tasks: tuple[str, ...] = ("t2i", "edit", "keyframes")
             ) -> tuple[dict, list[Generated]]:
    """Accuracies over the first ``n`` examples per task of ``world`` (a task not asked for reports None)."""
    results: dict[str, list[Generated]] = {
        t: generate_task(pipe, world, t, list(range(n)), steps, cfg_scale, sample_seed, keyframe_given)
        for t in tasks}

    def mean(task: str, key: str) -> float | None:
        rows = results.get(task)
        return round(float(np.mean([g.score[key] for g in rows])), 4) if rows else None

    metrics = {"t2i_color_acc": mean("t2i", "color"), "t2i_position_acc": mean("t2i", "position"),
               "t2i_shape_acc": mean("t2i", "shape"), "t2i_size_acc": mean("t2i", "size"),
               "edit_acc": mean("edit", "ok"), "keyframe_acc": mean("keyframes", "ok"), "n": n}
    return metrics, [g for t in tasks for g in results[t]]
