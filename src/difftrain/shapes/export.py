"""Write the shapes world to disk as a real, messy dataset, so ingest and curation run on files.

Layout under ``out_dir``::

    t2i/part<k>/t2i_<i>.png + .json    {"caption", "quality"} sidecars (folder kind), k = i % 4
    t2i/extra/t2i_<i>_copy.png + .json exact duplicates (byte-identical copies of t2i_<i>)
    t2i/extra/t2i_<i>_near.png + .json near duplicates (t2i_<i> with faint noise, re-encoded)
    shards/t2i-<s>.tar                 the last quarter of the t2i examples as webdataset shards
                                       (members t2i_<i>.png + t2i_<i>.json)
    edit/e_<i>/source.png, target.png, instruction.txt, scores.json    (edit kind)
    edit/manifest.jsonl                id, source, target, instruction, quality (manifest kind, task edit)
    keyframes/k_<i>/frame_000.png ..., caption.txt, scores.json        (keyframes kind)
    export.json                        settings, counts and the (source, key) of every variant

Each example gets a base size from ``sizes`` and an aspect from ``aspects``: the square scene is
rendered at the size, then the canvas is widened (aspect > 1) or heightened (< 1) by a whole number of
16-pixel tokens on each side (``canvas_size``) and the margin filled with the scene's own background, so a
centre crop recovers the scene, the caption stays true and the scene sits on the same token grid as on a
square canvas.

Every example has a ``quality`` score: clean ones 0.8-1.0; a ``degraded`` fraction of each task is
blurred, noised or given another example's caption, with quality below 0.3. A handful of t2i folder
examples carry the faults the other filters catch: exact and near duplicates, 16x16 images, empty
captions, a missing sidecar, a non-UTF-8 sidecar and a truncated PNG.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFilter

from difftrain.shapes.world import TASK_IDS, ShapesWorld

SOURCE_NAMES = {"t2i": "shapes_t2i", "shards": "shapes_t2i_shards", "edit": "shapes_edit",
                "keyframes": "shapes_keyframes"}
DEGRADED_KINDS = ("blur", "noise", "wrong_caption")
SPECIAL_KINDS = ("exact_dup", "near_dup", "tiny", "empty_caption", "missing_sidecar", "non_utf8", "truncated")
TINY_SIZE = 16
NEAR_DUP_MAX_BITS = 4  # a near-duplicate copy's phash is at most this many bits from its original's
T2I_PARTS = 4
SHARD_FRACTION = 0.25
SHARD_COUNT = 2
CLEAN_QUALITY = (0.8, 1.0)
BAD_QUALITY = (0.05, 0.28)


TOKEN_PX = 16   # pixels of one DiT token at the shapes presets' geometry (autoencoder factor 8, 2x2 patches)
EPOCHS = 1.0    # export_plan: passes of a run over each kept scene. A run from the store is as good as one on the fly
                # only when it sees as many distinct scenes: at 4 passes a scene the shape trails by 5-6 points


def canvas_size(size: int, aspect: float, align: int = TOKEN_PX) -> tuple[int, int]:
    """(width, height) of a square scene of side ``size`` widened/heightened towards ``aspect`` = w/h, with a
    margin on each side that is a whole number (at least 1) of ``align``-pixel tokens: so the scene's cells
    fall on the same token boundaries on every canvas, as they do on the square one. (A 48-pixel scene on a
    64-pixel 4:3 canvas would sit half a token off, and every place in it would be other token content than
    on the square: a model trained over both buckets then learns each separately.) 48 -> 80 and 96 -> 160
    for 5:3."""
    if abs(aspect - 1.0) < 1e-9:
        return size, size
    long = size * (aspect if aspect > 1 else 1 / aspect)
    margin = align * max(1, round((long - size) / (2 * align)))
    return (size + 2 * margin, size) if aspect > 1 else (size, size + 2 * margin)


def widen(img: np.ndarray, aspect: float, align: int = TOKEN_PX) -> np.ndarray:
    """Centre a square (S, S, 3) image on a canvas of the aspect (``canvas_size``), filled with its corner pixel."""
    w, h = canvas_size(img.shape[0], aspect, align)
    return on_canvas(img, h, w)


def on_canvas(img: np.ndarray, h: int, w: int) -> np.ndarray:
    """Centre an (S, S, 3) image on an h x w canvas (h, w >= S) filled with its corner pixel."""
    size = img.shape[0]
    if (h, w) == (size, size):
        return img
    if h < size or w < size:
        raise ValueError(f"a {size}x{size} scene does not fit on a {h}x{w} canvas")
    out = np.empty((h, w, 3), dtype=np.uint8)
    out[:] = img[0, 0]
    top, left = (h - size) // 2, (w - size) // 2
    out[top:top + size, left:left + size] = img
    return out


def centre_crop(img: np.ndarray) -> np.ndarray:
    """The centred square of an (H, W, 3) image (undoes ``widen``)."""
    h, w = img.shape[:2]
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return img[top:top + side, left:left + side]


def _png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.asarray(img, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _blur(img: np.ndarray) -> np.ndarray:
    radius = max(3.0, min(img.shape[:2]) / 10)
    return np.asarray(Image.fromarray(img).filter(ImageFilter.GaussianBlur(radius)))


def _noise(img: np.ndarray, rng: np.random.Generator, sigma: float) -> np.ndarray:
    noisy = img.astype(np.float32) + rng.normal(0.0, sigma, img.shape).astype(np.float32)
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8)


def _degrade(img: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    if kind == "blur":
        return _blur(img)
    if kind == "noise":
        return _noise(img, rng, 60.0)
    return img


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, sort_keys=True) + "\n").encode("utf-8")


def _quality(rng: np.random.Generator, bad: bool) -> float:
    lo, hi = BAD_QUALITY if bad else CLEAN_QUALITY
    return round(float(rng.uniform(lo, hi)), 4)


def _other_caption(world: ShapesWorld, task: str, i: int, n: int, rng: np.random.Generator) -> str:
    own = world.prompt(task, i)
    for _ in range(64):
        j = int(rng.integers(n))
        if j != i and (cap := world.prompt(task, j)) != own:
            return cap
    raise RuntimeError(f"no other {task} caption differs from example {i}'s")


def _assign_degraded(seed: int, task: str, n: int, fraction: float) -> dict[int, str]:
    """Exactly round(fraction * n) examples of a task, cycling through the degraded kinds."""
    k = int(round(fraction * n))
    perm = np.random.default_rng([seed, 0xDE, TASK_IDS[task]]).permutation(n)[:k]
    return {int(i): DEGRADED_KINDS[j % len(DEGRADED_KINDS)] for j, i in enumerate(sorted(perm))}


SMALLEST_SOURCE = {"t2i": 0.25, "edit": 1.0, "keyframes": 1.0}   # the share of a task's scenes its smallest source holds
STREAM_MARGIN = 1.5     # scenes a stream holds over its bucket's global batch, for the curation's spread


def export_plan(cfg, epochs: float = EPOCHS, degraded: float = 0.15, align: int = TOKEN_PX) -> dict:
    """The export a training config needs: the scene sizes and aspects of its buckets (every stage's short sides
    and w/h ratios; a bucket's canvas must be what ``canvas_size`` makes of its short side and ratio), the
    frames and motion of ``[data]``, and per task enough scenes that the run's samples of that task
    (``train.steps`` x the stages' global batch x the task's weight) see each kept scene about ``epochs``
    times (a ``degraded`` fraction and the planted faults are curated away). Scenes go to each size in
    proportion to the samples the stages at that size draw (``size_weights``: a stage's steps x its buckets'
    mean global batch, shared among its buckets), so a short first stage does not hold half the export.
    Raises ValueError for a bucket no scene placement gives."""
    from difftrain.config.stages import parse_stages

    stages = parse_stages(cfg)
    sizes, aspects = set(), set()
    by_size: dict[int, set] = {}
    for stage in stages:
        for b in stage.buckets:
            side = min(b.h, b.w)
            aspect = b.w / b.h
            w, h = canvas_size(side, aspect, align)
            if (h, w) != (b.h, b.w):
                raise ValueError(f"bucket {b.name} of stage {stage.name!r}: a {side}-pixel scene is placed on a "
                                 f"{h}x{w} canvas (margins of whole {align}-pixel units), not {b.h}x{b.w}")
            sizes.add(side)
            aspects.add(round(aspect, 6))
            by_size.setdefault(side, set()).add(round(aspect, 6))
    d, steps = cfg.data, cfg.train.steps
    per_size = dict.fromkeys(sizes, 0.0)
    for i, stage in enumerate(stages):
        end = stages[i + 1].start_step if i + 1 < len(stages) else steps
        stage_steps = max(0, min(end, steps) - stage.start_step)
        for b in stage.buckets:
            per_size[min(b.h, b.w)] += stage_steps * b.global_batch / len(stage.buckets)
    samples = sum(per_size.values())
    weights = {"t2i": d.t2i_weight, "edit": d.edit_weight, "keyframes": d.keyframe_weight}
    total = sum(weights.values()) or 1.0
    kept = (1.0 - degraded) * 0.95
    n = [max(64, int(np.ceil(samples * weights[t] / total / epochs / kept))) for t in ("t2i", "edit", "keyframes")]
    order = sorted(sizes)
    size_weights = tuple(per_size[z] / samples if samples else 1.0 / len(order) for z in order)
    # However short the run, every stream it trains on (a stage's bucket x task x source) holds a global batch of
    # its bucket after curation, with a margin: the loader leaves a smaller stream out of the plan, and a stage with
    # none is refused. A scene lands at one size (by size_weights) and one of that size's aspects; the smallest
    # source of a task holds SMALLEST_SOURCE of its scenes (t2i: the shards' quarter).
    share = dict(zip(order, size_weights))
    for i, stage in enumerate(stages):
        end = stages[i + 1].start_step if i + 1 < len(stages) else steps
        if min(end, steps) <= stage.start_step:
            continue
        for b in stage.buckets:
            side = min(b.h, b.w)
            fraction = share[side] / len(by_size[side]) * kept
            for j, task in enumerate(("t2i", "edit", "keyframes")):
                if weights[task] > 0 and fraction > 0:
                    need = b.global_batch * STREAM_MARGIN / (fraction * SMALLEST_SOURCE[task])
                    n[j] = max(n[j], int(np.ceil(need)))
    return {"n": tuple(n), "sizes": tuple(order), "size_weights": size_weights, "aspects": tuple(sorted(aspects)),
            "aspects_by_size": {z: tuple(sorted(by_size[z])) for z in order},
            "frames": d.frames, "motion": d.motion, "degraded": degraded, "align": align}


def export_sources(out_dir: str | os.PathLike, edit: str = "manifest") -> list[dict]:
    """``[[data.sources]]`` tables for an export; ``edit`` picks the manifest or the folder of triples."""
    root = Path(out_dir)
    if edit not in ("manifest", "folder"):
        raise ValueError(f"edit must be 'manifest' or 'folder', got {edit!r}")
    edit_src = ({"name": SOURCE_NAMES["edit"], "kind": "manifest", "task": "edit",
                 "path": str(root / "edit" / "manifest.jsonl")} if edit == "manifest"
                else {"name": SOURCE_NAMES["edit"], "kind": "edit", "path": str(root / "edit")})
    return [
        {"name": SOURCE_NAMES["t2i"], "kind": "folder", "path": str(root / "t2i")},
        {"name": SOURCE_NAMES["shards"], "kind": "webdataset", "path": str(root / "shards")},
        edit_src,
        {"name": SOURCE_NAMES["keyframes"], "kind": "keyframes", "path": str(root / "keyframes")},
    ]


def export_shapes(out_dir: str | os.PathLike, *, seed: int = 0, n: tuple[int, int, int] = (600, 400, 200),
                  sizes: tuple[int, ...] = (48, 96), aspects: tuple[float, ...] = (1.0, 5 / 3, 3 / 5),
                  frames: int = 3, motion: str = "across", degraded: float = 0.15, align: int = TOKEN_PX,
                  size_weights: tuple[float, ...] | None = None,
                  aspects_by_size: dict[int, tuple[float, ...]] | None = None) -> dict:
    """Write the dataset described in the module docstring; returns the summary also in export.json. ``align``:
    the margins' unit in pixels (``canvas_size``; 8 reproduces the half-token placement of earlier exports);
    ``size_weights``: the share of scenes at each of ``sizes`` (default: uniform); ``aspects_by_size``: the aspects
    a scene of each size is placed at (default: every one of ``aspects``), so no scene lands on a canvas no
    bucket has."""
    from difftrain.data.prepare.curate import hamming, phash_of_array

    n_t2i, n_edit, n_key = (int(x) for x in n)
    if min(n_t2i, n_edit, n_key) < 0:
        raise ValueError(f"example counts must be >= 0, got {n}")
    if not sizes or not aspects:
        raise ValueError("sizes and aspects must not be empty")
    if not 0.0 <= degraded < 1.0:
        raise ValueError(f"degraded must be in [0, 1), got {degraded}")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    worlds = {s: ShapesWorld(seed, size=s, frames=frames, motion=motion) for s in sorted(set(sizes))}
    tiny_world = ShapesWorld(seed, size=TINY_SIZE, frames=frames, motion=motion)
    any_world = worlds[min(worlds)]
    variants: dict[str, list[dict[str, str]]] = {"clean": []}
    for kind in DEGRADED_KINDS + SPECIAL_KINDS:
        variants[kind] = []
    pairs: dict[str, list[dict[str, Any]]] = {"exact_dup": [], "near_dup": []}

    def note(kind: str, source: str, key: str) -> None:
        variants[kind].append({"source": SOURCE_NAMES[source], "key": key})

    def example_rng(task: str, i: int) -> np.random.Generator:
        return np.random.default_rng([seed, 0xA5, TASK_IDS[task], i])

    if aspects_by_size is not None:
        aspects_by_size = {int(k): tuple(v) for k, v in aspects_by_size.items()}
        if set(aspects_by_size) != {int(z) for z in sizes} or not all(aspects_by_size.values()):
            raise ValueError(f"aspects_by_size {aspects_by_size}: expected a non-empty tuple of aspects for each size "
                             f"{tuple(sizes)}")
    if size_weights is not None:
        if len(size_weights) != len(sizes) or min(size_weights) < 0 or not sum(size_weights) > 0:
            raise ValueError(f"size_weights {size_weights}: expected {len(sizes)} non-negative weights, one per size "
                             f"{tuple(sizes)}, not all zero")
        size_p = np.asarray(size_weights, dtype=np.float64) / float(sum(size_weights))
        if np.allclose(size_p, 1.0 / len(sizes)):     # uniform: the unweighted draw (earlier exports unchanged)
            size_weights = None

    def pick_layout(rng: np.random.Generator) -> tuple[int, float]:
        if size_weights is None:
            size = int(sizes[int(rng.integers(len(sizes)))])
        else:
            size = int(sizes[int(np.searchsorted(np.cumsum(size_p), rng.random(), side="right").clip(0, len(sizes) - 1))])
        choices = aspects if aspects_by_size is None else aspects_by_size[size]
        return size, float(choices[int(rng.integers(len(choices)))])

    # ---------------------------------------------------------------- t2i
    n_shard = int(round(n_t2i * SHARD_FRACTION))
    n_folder = n_t2i - n_shard
    bad_t2i = _assign_degraded(seed, "t2i", n_t2i, degraded)
    handful = max(1, int(round(n_t2i / 100))) if n_t2i else 0
    clean_folder = [i for i in range(n_folder) if i not in bad_t2i]
    need = handful * len(SPECIAL_KINDS)
    if n_t2i and len(clean_folder) < need:
        raise ValueError(f"{n_t2i} t2i examples leave {len(clean_folder)} clean folder examples; "
                         f"the special variants need {need}: raise n[0] or lower degraded")
    order = np.random.default_rng([seed, 0xE8]).permutation(clean_folder).tolist() if clean_folder else []
    special: dict[int, str] = {}
    for j, kind in enumerate(SPECIAL_KINDS):
        for i in order[j * handful:(j + 1) * handful]:
            special[int(i)] = kind
    shard_members: list[list[tuple[str, bytes]]] = [[] for _ in range(SHARD_COUNT if n_shard >= SHARD_COUNT else 1)]
    for i in range(n_t2i):
        rng = example_rng("t2i", i)
        size, aspect = pick_layout(rng)
        bad = bad_t2i.get(i)
        kind = special.get(i)
        quality = _quality(rng, bad is not None)
        stem = f"t2i_{i:06d}"
        if kind == "tiny":
            img, caption, _ = tiny_world.t2i(i)
        else:
            img, caption, _ = worlds[size].t2i(i)
            img = widen(img, aspect, align)
        if bad is not None:
            img = _degrade(img, bad, rng)
            if bad == "wrong_caption":
                caption = _other_caption(any_world, "t2i", i, n_t2i, rng)
        png = _png(img)
        side = {"caption": caption, "quality": quality}
        if i >= n_folder:  # webdataset shards
            shard = (i - n_folder) * len(shard_members) // n_shard
            shard_members[shard] += [(stem + ".png", png), (stem + ".json", _json_bytes(side))]
            note(bad or "clean", "shards", stem)
            continue
        key = f"part{i % T2I_PARTS}/{stem}"
        base = root / "t2i" / f"part{i % T2I_PARTS}" / stem
        side_bytes = _json_bytes(side)
        if kind == "empty_caption":
            side_bytes = _json_bytes({"caption": "", "quality": quality})
        elif kind == "non_utf8":
            side_bytes = json.dumps({"caption": caption + " (caf\u00e9)", "quality": quality},
                                    ensure_ascii=False).encode("latin-1")
        elif kind == "truncated":
            png = png[: max(60, len(png) * 3 // 5)]
        _write(base.with_suffix(".png"), png)
        if kind != "missing_sidecar":
            _write(base.with_suffix(".json"), side_bytes)
        if kind in ("exact_dup", "near_dup"):
            suffix = "copy" if kind == "exact_dup" else "near"
            copy_key = f"extra/{stem}_{suffix}"
            copy_base = root / "t2i" / "extra" / f"{stem}_{suffix}"
            entry: dict[str, Any] = {"source": SOURCE_NAMES["t2i"], "original": key, "copy": copy_key}
            if kind == "exact_dup":
                copy_png = png
            else:
                noise_rng = np.random.default_rng([seed, 0x4E, i])
                want = phash_of_array(img)
                for sigma in (2.0, 1.0, 0.5, 0.0):
                    near = _noise(img, noise_rng, sigma) if sigma else img.copy()
                    if sigma == 0.0:  # last resort: one pixel one level off, still byte-different
                        near[0, 0, 0] = near[0, 0, 0] ^ 1
                    dist = hamming(want, phash_of_array(near))
                    if dist <= NEAR_DUP_MAX_BITS:
                        break
                copy_png = _png(near)
                entry["distance"] = dist
            _write(copy_base.with_suffix(".png"), copy_png)
            _write(copy_base.with_suffix(".json"), side_bytes)
            pairs[kind].append(entry)
            note("clean", "t2i", key)
            note(kind, "t2i", copy_key)
        else:
            note(kind or bad or "clean", "t2i", key)
    for s, members in enumerate(shard_members):
        if not members and n_shard == 0:
            continue
        shard_dir = root / "shards"
        shard_dir.mkdir(parents=True, exist_ok=True)
        with tarfile.open(shard_dir / f"t2i-{s:03d}.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tf.addfile(info, io.BytesIO(data))

    # ---------------------------------------------------------------- edit
    bad_edit = _assign_degraded(seed, "edit", n_edit, degraded)
    manifest_lines: list[bytes] = []
    for i in range(n_edit):
        rng = example_rng("edit", i)
        size, aspect = pick_layout(rng)
        bad = bad_edit.get(i)
        quality = _quality(rng, bad is not None)
        src, tgt, instruction, _ = worlds[size].edit(i)
        src, tgt = widen(src, aspect, align), widen(tgt, aspect, align)
        if bad is not None:
            src, tgt = _degrade(src, bad, rng), _degrade(tgt, bad, rng)
            if bad == "wrong_caption":
                instruction = _other_caption(any_world, "edit", i, n_edit, rng)
        key = f"e_{i:06d}"
        d = root / "edit" / key
        _write(d / "source.png", _png(src))
        _write(d / "target.png", _png(tgt))
        _write(d / "instruction.txt", (instruction + "\n").encode("utf-8"))
        _write(d / "scores.json", _json_bytes({"quality": quality}))
        manifest_lines.append(_json_bytes({"id": key, "source": f"{key}/source.png", "target": f"{key}/target.png",
                                           "instruction": instruction, "quality": quality}))
        note(bad or "clean", "edit", key)
    if n_edit:
        _write(root / "edit" / "manifest.jsonl", b"".join(manifest_lines))

    # ---------------------------------------------------------------- keyframes
    bad_key = _assign_degraded(seed, "keyframes", n_key, degraded)
    for i in range(n_key):
        rng = example_rng("keyframes", i)
        size, aspect = pick_layout(rng)
        bad = bad_key.get(i)
        quality = _quality(rng, bad is not None)
        clip, caption, _ = worlds[size].keyframes(i)
        clip = [widen(f, aspect, align) for f in clip]
        if bad is not None:
            clip = [_degrade(f, bad, rng) for f in clip]
            if bad == "wrong_caption":
                caption = _other_caption(any_world, "keyframes", i, n_key, rng)
        key = f"k_{i:06d}"
        d = root / "keyframes" / key
        for t, frame in enumerate(clip):
            _write(d / f"frame_{t:03d}.png", _png(frame))
        _write(d / "caption.txt", (caption + "\n").encode("utf-8"))
        _write(d / "scores.json", _json_bytes({"quality": quality}))
        note(bad or "clean", "keyframes", key)

    counts = {kind: len(v) for kind, v in variants.items()}
    summary = {
        "seed": seed, "n": [n_t2i, n_edit, n_key], "sizes": list(sizes), "aspects": list(aspects), "align": align,
        "size_weights": None if size_weights is None else list(size_weights),
        "aspects_by_size": None if aspects_by_size is None else {str(k): list(v) for k, v in aspects_by_size.items()},
        "frames": frames, "motion": motion, "degraded": degraded,
        "samples": {"t2i": n_folder + len(pairs["exact_dup"]) + len(pairs["near_dup"]), "t2i_shards": n_shard,
                    "edit": n_edit, "keyframes": n_key},
        "counts": counts,
        "variants": variants,
        "pairs": pairs,
        "sources": export_sources(""),  # paths relative to out_dir
    }
    (root / "export.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary


__all__ = ["export_shapes", "export_sources", "canvas_size", "widen", "on_canvas", "centre_crop", "SOURCE_NAMES",
           "DEGRADED_KINDS", "SPECIAL_KINDS"]
