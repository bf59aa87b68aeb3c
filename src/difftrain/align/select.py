"""Pairs chosen by the model (``difftrain select``): instead of every pair of every prompt's K candidates, a budget
of pairwise items, one pair a prompt, the pairs the model tells apart most.

The rules. Each candidate is encoded by the checkpoint's autoencoder (the latents DPO trains on).
- ``spread`` (the default): for each prompt the pair of its K candidates farthest apart in that latent space (root mean square
  difference) is its pair, and the ``items`` prompts whose pairs are farthest apart are asked.
- ``balanced``: a difference in latent space has two parts, a global one (each channel's mean over
  the image: tone, a colour cast, the background's shade) and a spatial one (what is left: layout, where and what
  the objects are). The global part moves every position at once, so a root mean square over the latent lets it
  drown the spatial part: pairs chosen by ``spread`` differ in tone and hardly in layout (on the shapes world,
  their backgrounds differ 2.4 times as much as a random pair's, their shapes' places less). ``balanced`` puts
  each part on its own scale, the mean of that part over every pair of the round, and scores a pair by the sum
  of the two: what is asked differs in either kind, whichever the raters turn out to care about. Measured through
  DPO (docs/dpo.md), it did not buy more gain than ``spread``, so it is not the default. A pair the model's latents hardly
tell apart carries almost no DPO signal (the two flow errors nearly cancel) and is the pair raters call a tie or
answer at random; a pair far apart is the one an answer teaches most. In a first round the policy *is* its
reference, so a margin of implicit rewards is zero for every pair and cannot choose: the spread is what the model
can say before any preference is known.

The result is a candidates folder of its own (``manifest.json`` saying what was chosen and how, ``candidates.jsonl``
with the two candidates of each chosen prompt, their images copied), which the rating app imports as a pairwise
batch of one item a prompt.
"""

from __future__ import annotations

import json
import os
import shutil
from itertools import combinations
from pathlib import Path

import numpy as np

from difftrain.errors import UserError

RULES = ("spread", "balanced", "random")


def _latents(cands_dir: Path, rows: list[dict], checkpoint: str) -> dict[str, np.ndarray]:
    import torch
    from PIL import Image

    from difftrain.config import from_dict
    from difftrain.models import build_autoencoder
    from difftrain.train.checkpoint import Checkpointer

    info = Checkpointer.read_info(checkpoint)
    cfg = from_dict(info["config"], f"{info['path']}/trainer.json")
    ae = build_autoencoder(cfg.autoencoder.kind, cfg.autoencoder.factor, cfg.autoencoder.path,
                           cfg.autoencoder.scaling, cfg.autoencoder.shift)
    out = {}
    root = cands_dir.resolve()
    for r in rows:
        frames = r.get("frames") or [r.get("image", "")]
        xs = []
        for name in frames:
            p = _inside(cands_dir, root, r, "image", name)
            with Image.open(p) as im:
                xs.append(torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 127.5 - 1)
                          .permute(2, 0, 1))
        with torch.no_grad():
            out[r["id"]] = ae.encode(torch.stack(xs)).float().numpy()      # (frames, channels, h, w)
    return out


def _rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(a ** 2)))


def _balanced(lat: dict[str, np.ndarray], by: dict[str, list[dict]]) -> list[tuple[float, str, str, str]]:
    """Each prompt's best pair by the balanced score, as (score, prompt_id, id, id)."""
    glob = {k: v.mean(axis=(-2, -1), keepdims=True) for k, v in lat.items()}
    parts = []
    for pid, cs in sorted(by.items()):
        for x, y in combinations(cs, 2):
            a, b = x["id"], y["id"]
            parts.append((pid, a, b, _rms(glob[a] - glob[b]),
                          _rms((lat[a] - glob[a]) - (lat[b] - glob[b]))))
    scale_g = float(np.mean([p[3] for p in parts])) or 1.0       # a round where no pair differs in tone: unscaled
    scale_s = float(np.mean([p[4] for p in parts])) or 1.0
    best: dict[str, tuple[float, str, str, str]] = {}
    for pid, a, b, g, sp in parts:
        pair = (g / scale_g + sp / scale_s, pid, a, b)
        if pid not in best or pair > best[pid]:
            best[pid] = pair
    return list(best.values())


def _inside(cands_dir: Path, root: Path, row: dict, key: str, name) -> Path:
    """A path a candidates file names, checked: a file inside the folder."""
    p = (root / str(name)).resolve() if isinstance(name, str) and name else None
    if p is None or not p.is_relative_to(root) or not p.is_file():
        raise UserError(f"{cands_dir}/candidates.jsonl: candidate {row.get('id')!r}: {key} {name!r} is not a file "
                        "inside the folder")
    return p


def select_pairs(candidates: str | Path, out: str | Path, items: int, rule: str = "spread",
                 seed: int = 0) -> dict:
    """Write the chosen pairs as a candidates folder at ``out``; returns what was chosen."""
    from difftrain.align.candidates import read_candidates

    if rule not in RULES:
        raise UserError(f"--rule {rule!r}: expected one of {RULES}")
    if isinstance(items, bool) or not isinstance(items, int) or items < 1:
        raise UserError(f"--items {items!r}: expected a whole number >= 1 (pairs to ask about)")
    cdir, odir = Path(candidates), Path(out)
    manifest, rows = read_candidates(cdir)
    if odir.exists() and any(odir.iterdir()):
        raise UserError(f"--out {odir}: exists and is not empty")
    by: dict[str, list[dict]] = {}
    for n, r in enumerate(rows, 1):
        if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not isinstance(r.get("prompt_id"), str):
            raise UserError(f"{cdir}/candidates.jsonl:{n}: expected an object with string id and prompt_id")
        by.setdefault(r["prompt_id"], []).append(r)
    if any(len(v) < 2 for v in by.values()):
        raise UserError(f"{cdir}: a prompt with fewer than 2 candidates has no pair to ask about")
    root = cdir.resolve()
    for r in rows:                       # every path checked before anything is chosen, whichever the rule
        if r.get("frames") is not None and not isinstance(r["frames"], list):
            raise UserError(f"{cdir}/candidates.jsonl: candidate {r['id']!r}: frames must be a list")
        for f in r.get("frames") or [r.get("image")]:
            _inside(cdir, root, r, "image", f)
        if r.get("source"):
            _inside(cdir, root, r, "source", r["source"])
    rng = np.random.default_rng(seed)
    chosen: list[tuple[float, str, dict, dict]] = []
    if rule in ("spread", "balanced"):
        lat = _latents(cdir, rows, manifest.get("checkpoint", ""))
        for pid, cs in sorted(by.items()):
            if len({lat[c["id"]].shape for c in cs}) > 1:
                raise UserError(f"{cdir}/candidates.jsonl: prompt {pid!r}: its candidates differ in size or frames")
        if rule == "spread":
            best = [max((_rms(lat[x["id"]] - lat[y["id"]]), pid, x["id"], y["id"]) for x, y in combinations(cs, 2))
                    for pid, cs in sorted(by.items())]
        else:
            best = _balanced(lat, by)
        for d, pid, a, b in best:
            ids = {c["id"]: c for c in by[pid]}
            chosen.append((d, pid, ids[a], ids[b]))
        chosen.sort(key=lambda c: (-c[0], c[1]))
    else:
        for pid, cs in sorted(by.items()):
            i, j = rng.choice(len(cs), 2, replace=False)
            chosen.append((float(rng.random()), pid, cs[int(i)], cs[int(j)]))
        chosen.sort(key=lambda c: c[0])
    chosen = chosen[:items]
    tmp = odir.with_name(f".{odir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / "images").mkdir(parents=True)
        lines = []
        for n, (_, pid, a, b) in enumerate(chosen):
            for side, c in enumerate((a, b)):
                c = {**c, "k": side}          # numbered 0 and 1 in the pair (its id says where it came from)

                def copy(key: str, name, i: int = 0) -> str:
                    src = _inside(cdir, root, c, key, name)
                    # named by position, not by the id: an id is text from a file
                    dst = Path("images") / f"{n:06d}-{side}-{key}{i}{src.suffix.lower()}"
                    shutil.copyfile(src, tmp / dst)
                    return str(dst)

                if c.get("frames"):
                    c["frames"] = [copy("frame", f, i) for i, f in enumerate(c["frames"])]
                    c["image"] = c["frames"][0]
                elif c.get("image") is not None:
                    c["image"] = copy("image", c["image"])
                if c.get("source"):
                    c["source"] = copy("source", c["source"])
                lines.append(json.dumps(c))
        meta = {**manifest, "k": 2, "selected": {"from": str(root), "rule": rule, "items": len(chosen),
                                                 "prompts": len(by), "seed": seed,
                                                 "spread": ([round(c[0], 5) for c in chosen]
                                                            if rule != "random" else None)}}
        (tmp / "candidates.jsonl").write_text("".join(x + "\n" for x in lines))
        (tmp / "manifest.json").write_text(json.dumps(meta, indent=1))
        if odir.exists():
            odir.rmdir()
        os.replace(tmp, odir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(odir), "rule": rule, "items": len(chosen), "prompts": len(by),
            "candidates": 2 * len(chosen)}
