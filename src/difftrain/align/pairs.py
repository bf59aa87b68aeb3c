"""``difftrain pairs``: rankings of candidates -> a preference pairs file (Parquet, ``data.pairs.PAIR_COLUMNS``).

Rankings are JSONL, one ranking a line, from any rater (the rating app's export, a script, a person):
``{"prompt_id": ..., "rater": ..., "order": [best, ..., worst]}`` where an entry is a candidate id or a list of
candidate ids ranked equal. For each prompt and each two of its candidates that some raters ranked, the
majority over those raters decides the winner (equal votes: the pair is dropped as a tie); ``agreement`` is the
share of those raters who sided with the majority, ``raters`` their number. ``--mode all`` keeps every such
pair (C(K, 2) a prompt); ``best-worst`` keeps one a prompt: the best and the worst candidate by mean rank
(ties dropped). Pairs are split by prompt (a prompt's pairs are all train or all validation), by a hash of
(seed, prompt id), so the split does not depend on the order of the input. Each row keeps its candidates'
noise seeds (a pair can reuse its candidates' own noise).

The Pick-a-Pic layout (``caption``, ``jpg_0``, ``jpg_1``, ``label_0``: 1 = image 0 preferred, 0 = image 1,
0.5 = tie, dropped; ``model_0``, ``model_1``) is read too (``--pickapic``): its images are written next to the
pairs file (``NAME.images/``), optionally centre-cropped and resized to one size.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from itertools import combinations
from pathlib import Path

from difftrain.errors import UserError

MODES = ("all", "best-worst")


def _split(seed: int, prompt_id: str, validation: float) -> str:
    h = int.from_bytes(hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[:8], "big") / 2**64
    return "validation" if h < validation else "train"


def read_rankings(path: str | Path, known: dict[str, dict]) -> dict[str, list[tuple[str, list[list[str]]]]]:
    """prompt id -> [(rater, order as groups of tied ids)], checked against the candidates ``known`` (id -> row)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: rankings file not found")
    out: dict[str, list] = {}
    for n, raw in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{p}:{n}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not a JSON object ({e.msg})") from None
        if not isinstance(obj, dict) or not {"prompt_id", "order"} <= set(obj):
            raise UserError(f"{where}: expected an object with 'prompt_id', 'order' (and 'rater')")
        order = obj["order"]
        if not isinstance(order, list):
            raise UserError(f"{where}: 'order' must be a list (best first; a list inside it = tied candidates)")
        groups = [[x] if isinstance(x, str) else x for x in order]
        ids = [c for g in groups for c in g]
        if not all(isinstance(c, str) for c in ids):
            raise UserError(f"{where}: 'order' holds candidate ids (strings) or lists of them")
        if len(set(ids)) != len(ids):
            raise UserError(f"{where}: a candidate appears twice in 'order'")
        for c in ids:
            if c not in known:
                raise UserError(f"{where}: unknown candidate {c!r} (not in the candidates folder)")
            if known[c]["prompt_id"] != obj["prompt_id"]:
                raise UserError(f"{where}: candidate {c!r} is of prompt {known[c]['prompt_id']!r}, not "
                                f"{obj['prompt_id']!r}")
        out.setdefault(str(obj["prompt_id"]), []).append((str(obj.get("rater", f"line{n}")), groups))
    if not out:
        raise UserError(f"{p}: no rankings in it")
    return out


def votes(rankings: list[tuple[str, list[list[str]]]]) -> dict[tuple[str, str], list[int]]:
    """(a, b) with a < b -> [raters ranking a above b, raters ranking b above a, raters ranking them equal]."""
    out: dict[tuple[str, str], list[int]] = {}
    for _, groups in rankings:
        pos = {c: i for i, g in enumerate(groups) for c in g}
        for a, b in combinations(sorted(pos), 2):
            v = out.setdefault((a, b), [0, 0, 0])
            v[0 if pos[a] < pos[b] else 1 if pos[b] < pos[a] else 2] += 1
    return out


def make_pairs(rankings_path: str | Path, candidates_dir: str | Path, out: str | Path, mode: str = "all",
               validation: float = 0.1, seed: int = 0) -> dict:
    from difftrain.align.candidates import read_candidates

    if mode not in MODES:
        raise UserError(f"--mode {mode!r}: expected one of {MODES}")
    if not 0 <= validation < 1:
        raise UserError(f"--validation {validation}: expected a fraction in [0, 1)")
    manifest, cands = read_candidates(candidates_dir)
    known = {c["id"]: c for c in cands}
    ranked = read_rankings(rankings_path, known)
    outp = Path(out)
    base, cdir = outp.parent.resolve(), Path(candidates_dir).resolve()
    rows, ties = [], 0
    for prompt_id in sorted(ranked):
        v = votes(ranked[prompt_id])
        keep = list(v)
        if mode == "best-worst":
            mean = _mean_rank(ranked[prompt_id])
            best, worst = min(mean, key=mean.get), max(mean, key=mean.get)
            keep = [tuple(sorted((best, worst)))] if mean[best] < mean[worst] else []
        for a, b in keep:
            up, down, same = v[(a, b)]
            if up == down:
                ties += 1
                continue
            w, lo = (a, b) if up > down else (b, a)
            cw, cl = known[w], known[lo]
            rows.append({"pair_id": len(rows), "prompt_id": prompt_id, "prompt": cw["prompt"], "task": cw["task"],
                         "winner": w, "loser": lo,
                         "winner_image": os.path.relpath(cdir / cw["image"], base),
                         "loser_image": os.path.relpath(cdir / cl["image"], base),
                         "source_image": (os.path.relpath(cdir / cw["source"], base)
                                          if cw.get("source") else ""), "winner_seed": int(cw["noise_seed"]),
                         "loser_seed": int(cl["noise_seed"]), "agreement": max(up, down) / (up + down + same),
                         "raters": up + down + same, "split": _split(seed, prompt_id, validation)})
    if any(r["task"] == "keyframes" for r in rows):
        raise UserError(f"{rankings_path}: keyframe candidates were ranked; DPO pairs are text-to-image or edits")
    summary = write_pairs(rows, outp, {"candidates": str(cdir), "checkpoint_digest": manifest.get("digest", ""),
                                       "mode": mode})
    summary["ties_dropped"] = ties
    return summary


def _mean_rank(rankings: list[tuple[str, list[list[str]]]]) -> dict[str, float]:
    pos: dict[str, list[float]] = {}
    for _, groups in rankings:
        i = 0
        for g in groups:
            for c in g:                              # tied candidates share the mean of their positions
                pos.setdefault(c, []).append(i + (len(g) - 1) / 2)
            i += len(g)
    return {c: sum(x) / len(x) for c, x in pos.items()}


def write_pairs(rows: list[dict], out: Path, meta: dict) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from difftrain.data.store.pairs import PAIR_COLUMNS

    if not rows:
        raise UserError("no pairs: every ranked pair was a tie (or nothing was ranked)")
    schema = pa.schema([pa.field(c, getattr(pa, {"double": "float64"}.get(t, t))()) for c, t in PAIR_COLUMNS.items()]
                       + [pa.field(c, pa.string()) for c in sorted(set(rows[0]) - set(PAIR_COLUMNS))],
                       metadata={"difftrain": json.dumps(meta)})
    table = pa.Table.from_pylist(rows, schema=schema)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    split = [r["split"] for r in rows]
    return {"out": str(out), "pairs": len(rows), "train": split.count("train"),
            "validation": split.count("validation"), "prompts": len({r["prompt_id"] for r in rows})}


def pickapic_pairs(path: str | Path, out: str | Path, validation: float = 0.1, seed: int = 0,
                   image_size: int = 0) -> dict:
    """Pairs from a file in the Pick-a-Pic layout; ties (label_0 = 0.5) dropped."""
    from difftrain.data.store.pairs import read_table

    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: file not found")
    need = ["caption", "jpg_0", "jpg_1", "label_0", "model_0", "model_1"]
    table = read_table(p, need, "a file in the Pick-a-Pic layout")
    outp = Path(out)
    img_dir = outp.with_name(f"{outp.name}.images")
    img_dir.mkdir(parents=True, exist_ok=True)
    rows, ties = [], 0
    for i, r in enumerate(table.select(need).to_pylist()):
        label = r["label_0"]
        if label not in (0, 0.5, 1):
            raise UserError(f"{p}: row {i}: label_0 = {label!r}, expected 1 (image 0 preferred), 0 or 0.5 (tie)")
        if label == 0.5:
            ties += 1
            continue
        names = []
        for side in (0, 1):
            name = f"{i:08d}_{side}.png"
            _save_image(r[f"jpg_{side}"], img_dir / name, image_size, f"{p}: row {i}: jpg_{side}")
            names.append(os.path.relpath(img_dir / name, outp.parent))
        w = 0 if label == 1 else 1
        prompt_id = hashlib.sha1(r["caption"].encode()).hexdigest()[:16]
        rows.append({"pair_id": len(rows), "prompt_id": prompt_id, "prompt": r["caption"], "task": "t2i",
                     "winner": f"row{i}_{w}", "loser": f"row{i}_{1 - w}", "winner_image": names[w],
                     "loser_image": names[1 - w], "source_image": "", "winner_seed": -1, "loser_seed": -1,
                     "agreement": 1.0, "raters": 1, "split": _split(seed, prompt_id, validation),
                     "winner_model": str(r[f"model_{w}"]), "loser_model": str(r[f"model_{1 - w}"])})
    summary = write_pairs(rows, outp, {"source": str(p), "layout": "pickapic"})
    summary["ties_dropped"] = ties
    return summary


def _save_image(data: bytes, path: Path, size: int, where: str) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            im = im.convert("RGB")
            if size:
                side = min(im.size)
                left, top = (im.width - side) // 2, (im.height - side) // 2
                im = im.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.BICUBIC)
            im.save(path, format="PNG")
    except (UnidentifiedImageError, OSError, TypeError) as e:
        raise UserError(f"{where}: not an image ({e.__class__.__name__}: {e})") from None
