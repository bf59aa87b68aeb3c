"""Evaluate a model on the shapes world: generate for N prompts per task, read the images back with
the shapes evaluator, report accuracies. Used by ``difftrain eval``, ``demo`` and training.

``evaluate`` reports every accuracy twice: on prompts of the training split (combinations the model
has seen, drawn with the evaluation seed) and, under keys prefixed ``heldout_``, on prompts whose
(colour, shape, cell) combination training never shows (``difftrain.shapes.world.HELDOUT_TRIPLES``).
Keyframes are generated both from the caption alone and with the first frame given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from difftrain.shapes.world import EDIT_KINDS, ShapesWorld
from difftrain.shapes.evaluate import read_image, score_edit, score_keyframes, score_t2i
from difftrain.shapes.loader import make_batch
from difftrain.diffusion.pipeline import Pipeline

KEYFRAME_MODES = ("none", "first")
HELDOUT_PREFIX = "heldout_"
# Accuracy keys of one split; the held-out split reports each with HELDOUT_PREFIX in front.
EDIT_KIND_KEYS = tuple(f"edit_{k}_acc" for k in EDIT_KINDS)   # edit_acc over the edits of one kind
SPLIT_KEYS = ("t2i_color_acc", "t2i_position_acc", "t2i_shape_acc", "t2i_size_acc", "t2i_acc", "edit_acc",
              *EDIT_KIND_KEYS, "keyframe_acc", "keyframe_acc_none", "keyframe_acc_first", "one_shape_rate")
EVAL_KEYS = SPLIT_KEYS + tuple(HELDOUT_PREFIX + k for k in SPLIT_KEYS) + ("n",)


@dataclass
class Generated:
    task: str
    prompt: str
    images: list[np.ndarray]          # what to show: (reference,) generated frame(s)
    score: dict
    split: str = "train"              # the world split the prompt came from
    keyframe_given: str | None = None  # keyframes: which frames were given ('none' or 'first')
    one_shape: list[bool] = field(default_factory=list)  # per generated image: read as exactly one shape
    edit_kind: str | None = None      # edits: which attribute the instruction changes


def generate_task(pipe: Pipeline, world: ShapesWorld, task: str, indices: list[int], steps: int, cfg_scale: float,
                  seed: int, keyframe_given: str = "first", batch_size: int = 32,
                  canvas: tuple[int, int] | None = None) -> list[Generated]:
    """Generate and score examples ``indices`` of ``task`` from ``world`` (whichever split it is). ``canvas``:
    generate on an (h, w) canvas with the world's scene centred on it (given frames placed so), and score the
    centre square, as the exported world lays scenes on aspect buckets."""
    if task == "keyframes" and keyframe_given not in KEYFRAME_MODES:
        raise ValueError(f"keyframe_given must be one of {', '.join(KEYFRAME_MODES)}, got {keyframe_given!r}")
    from difftrain.parallel.dist import gather_objects, rank_world

    split = getattr(world, "split", "train")
    # Under torchrun the model is sharded and every forward is collective: the batches go round-robin over the
    # ranks, each generated whole with its own noise seed (so the images are one process's), and a rank without
    # a batch in a round generates a one-example stand-in, to keep the forwards in step.
    rank, ranks = rank_world()
    starts = list(range(0, len(indices), batch_size))
    rounds = -(-len(starts) // ranks)
    out: list[Generated] = []
    for i in range(rounds):
        j = i * ranks + rank
        lo = starts[j] if j < len(starts) else None
        chunk = indices[lo:lo + batch_size] if lo is not None else indices[:1]
        targets = None
        if task == "keyframes":
            k = world.frames
            targets = [[f != 0 if keyframe_given == "first" else True for f in range(k)] for _ in chunk]
        batch = make_batch(world, pipe.autoencoder, pipe.text_encoder.tokenize, task, chunk, targets, canvas=canvas)
        imgs = pipe.to_images(pipe.sample(batch, steps, cfg_scale, seed=seed + (lo or 0)))
        if lo is None:
            continue
        if canvas is not None:                     # the scene: the centre square
            top, left = (canvas[0] - world.size) // 2, (canvas[1] - world.size) // 2
            imgs = np.ascontiguousarray(imgs[:, :, top:top + world.size, left:left + world.size])
        for b, m in enumerate(batch.meta):
            if task == "t2i":
                s = score_t2i(imgs[b, 0], m["spec"])
                out.append(Generated(task, batch.prompts[b], [imgs[b, 0]], s, split, None, [s["one_shape"]]))
            elif task == "edit":
                s = score_edit(imgs[b, 0], m["spec"], m["source"])
                out.append(Generated(task, batch.prompts[b], [m["source"], imgs[b, 0]], s, split, None,
                                     [s["one_shape"]], m["spec"].kind))
            else:
                readings = [read_image(f) for f in imgs[b]]
                s = score_keyframes(imgs[b], m["spec"], readings)
                generated = [r.one_shape for f, r in enumerate(readings) if targets[b][f]]  # given frames: not ours
                out.append(Generated(task, batch.prompts[b], list(imgs[b]), s, split, keyframe_given, generated))
    if ranks == 1:
        return out
    return _merge_rounds(gather_objects(out), len(starts), ranks, batch_size, len(indices))


def _merge_rounds(per_rank: list[list], batches: int, ranks: int, batch_size: int, n: int) -> list:
    """Each rank's generations (its batches in order: b, b + ranks, ...) back into the order of one process."""
    out, taken = [], [0] * ranks
    for b in range(batches):
        r, size = b % ranks, min(batch_size, n - b * batch_size)
        out += per_rank[r][taken[r]:taken[r] + size]
        taken[r] += size
    return out


def _split_metrics(results: dict[str, list[Generated]], keyframe_given: str) -> dict[str, float | None]:
    """Accuracies of one split from its generations (keys of SPLIT_KEYS; None where nothing was generated)."""
    def mean(key: str, score: str) -> float | None:
        rows = results.get(key)
        return round(float(np.mean([bool(g.score[score]) for g in rows])), 4) if rows else None

    def edit_kind(kind: str) -> float | None:
        rows = [g for g in results.get("edit", []) if g.edit_kind == kind]
        return round(float(np.mean([bool(g.score["ok"]) for g in rows])), 4) if rows else None

    flags = [f for rows in results.values() for g in rows for f in g.one_shape]
    return {"t2i_color_acc": mean("t2i", "color"), "t2i_position_acc": mean("t2i", "position"),
            "t2i_shape_acc": mean("t2i", "shape"), "t2i_size_acc": mean("t2i", "size"),
            "t2i_acc": mean("t2i", "ok"), "edit_acc": mean("edit", "ok"),
            **{key: edit_kind(kind) for key, kind in zip(EDIT_KIND_KEYS, EDIT_KINDS)},
            "keyframe_acc": mean(f"keyframes_{keyframe_given}", "ok"),
            "keyframe_acc_none": mean("keyframes_none", "ok"), "keyframe_acc_first": mean("keyframes_first", "ok"),
            "one_shape_rate": round(float(np.mean(flags)), 4) if flags else None}


def evaluate(pipe: Pipeline, world: ShapesWorld, n: int, steps: int, cfg_scale: float, sample_seed: int = 0,
             keyframe_given: str = "first", tasks: tuple[str, ...] = ("t2i", "edit", "keyframes"),
             heldout: bool = True, canvas: tuple[int, int] | None = None) -> tuple[dict, list[Generated]]:
    """Accuracies over the first ``n`` examples per task, on seen and on held-out combinations.

    ``world`` gives the seed, image size, frames, background and motion; its training split supplies
    the seen prompts and its held-out split (built here) the held-out ones, reported under
    ``heldout_`` keys (``heldout=False`` skips them; their keys are then None). Keyframes are
    generated with no frame given and with the first frame given (``keyframe_acc_none``,
    ``keyframe_acc_first``); ``keyframe_acc`` repeats the one ``keyframe_given`` names.
    ``one_shape_rate`` is the fraction of generated images (t2i images, edit outputs, predicted
    keyframes) read as exactly one shape with no ghost of an edit's source. A task not asked for
    reports None. Generations come back seen first, in task order, the configured keyframe mode first.
    ``canvas``: generate on an (h, w) canvas around the world's scene and score its centre (``generate_task``).
    """
    if keyframe_given not in KEYFRAME_MODES:
        raise ValueError(f"keyframe_given must be one of {', '.join(KEYFRAME_MODES)}, got {keyframe_given!r}")
    modes = (keyframe_given,) + tuple(m for m in KEYFRAME_MODES if m != keyframe_given)
    seen = world if getattr(world, "split", "train") == "train" else world.with_split("train")
    splits = [("", seen)] + ([(HELDOUT_PREFIX, seen.with_split("heldout"))] if heldout else [])
    metrics: dict = {}
    gens: list[Generated] = []
    for prefix, w in splits:
        results: dict[str, list[Generated]] = {}
        for task in tasks:
            if task == "keyframes":
                for mode in modes:
                    results[f"keyframes_{mode}"] = generate_task(pipe, w, task, list(range(n)), steps, cfg_scale,
                                                                 sample_seed, mode, canvas=canvas)
            else:
                results[task] = generate_task(pipe, w, task, list(range(n)), steps, cfg_scale, sample_seed,
                                              canvas=canvas)
        metrics.update({prefix + k: v for k, v in _split_metrics(results, keyframe_given).items()})
        gens += [g for rows in results.values() for g in rows]
    if not heldout:
        metrics.update({HELDOUT_PREFIX + k: None for k in SPLIT_KEYS})
    metrics["n"] = n
    return metrics, gens


def eval_buckets(cfg) -> list[tuple[str, int, tuple[int, int]]]:
    """(name, scene side, canvas (h, w)) of every bucket of the config's last stage (``data.stages``; by
    default one ``data.image_size`` square): a bucket's scene is its short side, centred as the exported world
    places it."""
    from difftrain.config.stages import parse_stages

    stage = parse_stages(cfg)[-1]
    return [(b.name, min(b.h, b.w), (b.h, b.w)) for b in stage.buckets]


def evaluate_buckets(pipe: Pipeline, cfg, world_seed: int, n: int, steps: int, cfg_scale: float,
                     sample_seed: int = 0, tasks: tuple[str, ...] = ("t2i", "edit", "keyframes"),
                     heldout: bool = True) -> tuple[dict, list[Generated]]:
    """``evaluate`` at every bucket (resolution and aspect) of the config's last stage: the accuracies of each
    under ``by_bucket``, their mean at the top level (the keys of ``evaluate``), and the buckets evaluated
    (``buckets``, ``stage``). A run trained over aspect buckets is judged where it was trained."""
    from difftrain.config.stages import parse_stages
    from difftrain.shapes import world_from_config

    base = world_from_config(cfg.data, world_seed)
    per: dict[str, dict] = {}
    gens: list[Generated] = []
    for name, side, canvas in eval_buckets(cfg):
        world = ShapesWorld(base.seed, side, base.frames, base.bg_range, base.motion)
        m, g = evaluate(pipe, world, n, steps, cfg_scale, sample_seed, cfg.eval.keyframe_given, tasks, heldout,
                        canvas=None if canvas == (side, side) else canvas)
        per[name], gens = m, gens + g
    metrics: dict = {}
    for key in EVAL_KEYS:
        vals = [m[key] for m in per.values() if m.get(key) is not None]
        metrics[key] = (n if key == "n" else round(float(np.mean(vals)), 4)) if vals else None
    metrics.update(by_bucket=per, buckets=list(per), stage=parse_stages(cfg)[-1].name)
    return metrics, gens


def preview_grid(pipe: Pipeline, cfg, path, n: int = 4, write: bool = True, prompts: list[str] | None = None):
    """A grid of samples with the config's sampling settings: text-to-image at ``data.image_size`` from
    ``prompts`` when given, else ``n`` per task of the shapes world the config describes (``eval.seed``);
    written as a PNG when ``write`` (rank 0). Every rank calls it under FSDP."""
    from difftrain.images import caption_grid

    rows = preview_rows(pipe, cfg, n, prompts)
    return caption_grid(rows, path) if write else path


PREVIEW_MAX_SIDE = 1024       # a preview's default side: data.image_size, at most this


@dataclass(frozen=True)
class PreviewSpec:
    prompt: str
    width: int
    height: int
    seed: int
    guidance: float


def preview_specs(cfg, prompts: list[str] | None) -> list[PreviewSpec]:
    """What the previews draw: ``preview.prompts`` (each with its own size, seed and guidance), else ``prompts`` (the
    run's own captions or ``sample.prompts``' file) at ``preview.width`` x ``preview.height`` (default: data.image_size,
    at most 1024 a side); the first ``preview.count``."""
    p, s = cfg.preview, cfg.sample
    width = p.width or min(cfg.data.image_size, PREVIEW_MAX_SIDE)
    height = p.height or min(cfg.data.image_size, PREVIEW_MAX_SIDE)
    items = p.prompts or [{"prompt": x} for x in (prompts or [])]
    return [PreviewSpec(it["prompt"], int(it.get("width", width)), int(it.get("height", height)),
                        int(it.get("seed", s.seed)), float(it.get("guidance", s.guidance))) for it in items[:p.count]]


def preview_rows(pipe: Pipeline, cfg, n: int = 4, prompts: list[str] | None = None,
                 on_step=None) -> list[tuple[list, str]]:
    """``preview_grid``'s rows, (images, prompt) each, with fixed seeds (``sample.seed``, or each preview's own): the
    same prompts and noise every time, so two weights' rows differ only by the weights. ``on_step(i)`` is called
    before each sampler step of a prompted preview (a trainer beats its watchdog and checks for a stop there)."""
    from difftrain.shapes import world_from_config

    s, rows = cfg.sample, []
    specs = preview_specs(cfg, prompts)
    if specs:
        kept = pipe.guidance
        try:
            for spec in specs:          # one at a time: each its own size, seed and guidance
                pipe.guidance = spec.guidance
                lat = pipe.sample(pipe.blank_batch([spec.prompt], spec.height, spec.width), s.steps, s.cfg_scale,
                                  seed=spec.seed, on_step=on_step)
                rows.append(([pipe.to_images(lat)[0, 0]], spec.prompt))
        finally:
            pipe.guidance = kept
    else:
        world = world_from_config(cfg.data, cfg.eval.seed)
        for task in ("t2i", "edit", "keyframes"):
            for g in generate_task(pipe, world, task, list(range(n)), s.steps, s.cfg_scale, s.seed,
                                   cfg.eval.keyframe_given):
                rows.append((g.images, g.prompt))
    return rows
