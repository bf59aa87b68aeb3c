"""Batches: a candidates folder (``difftrain candidates``'s manifest.json, candidates.jsonl and images/) imported
into the database as items to rate.

- ``ranking``: one item a prompt, its K candidates to order;
- ``pairwise``: one item a pair of one prompt's candidates (every pair of K; K = 2 is one item a prompt);
- a **comparison** (two folders made by two checkpoints on the same prompts and seeds): one pairwise item per
  (prompt, k), A's candidate k against B's; its answers give A's win rate over B.
Gold items: prompts whose answer is known (``--gold``: JSONL of ``{"prompt_id", "order": [best, ...]}``) become
gold items only: mixed into every rater's stream at the batch's gold rate, never exported as preferences.
Every item, candidate and image gets a random opaque id: the pages and the API show no path, seed, candidate
id or model, and a gold item's ids look like any other's.
"""

from __future__ import annotations

import json
import os
import secrets
from itertools import combinations
from pathlib import Path

from sqlalchemy import select

from difftrain_rate.db import MAX_RATERS, Database, Image, Item, RatingBatch
from difftrain_rate.errors import RateError

QUESTIONS = ("overall", "aesthetics", "prompt_fit")


def opaque() -> str:
    return secrets.token_urlsafe(16)         # 22 characters of [A-Za-z0-9_-]


# Every key a candidates line may carry. A path field is confined to the folder; a key this list does not know is
# refused, so a field a new task adds cannot reach the app unchecked (it is declared here as a path or not).
PATH_FIELDS = ("image", "frames", "source")
TEXT_FIELDS = {"id": 200, "prompt_id": 200, "prompt": 4000}
INT_FIELDS = ("k", "seed", "noise_seed")
TASKS = ("t2i", "edit", "keyframes")
MAX_K = 64
MAX_IMAGE_BYTES = 32 << 20
MAX_IMAGE_PIXELS = 4096 * 4096


def confined(root: Path, value, where: str, field: str) -> Path:
    """``value`` (a path relative to ``root``, or absolute) resolved with every symlink followed; refused unless it
    is a regular file inside ``root`` (itself resolved)."""
    if not isinstance(value, str) or not value or "\x00" in value or len(value) > 1024:
        raise RateError(f"{where}: {field} {value!r:.80}: expected a file path inside the folder")
    try:
        p = (root / value).resolve(strict=True)
    except (OSError, RuntimeError):            # missing, a symlink loop, a name too long
        if not Path(os.path.normpath(root / value)).is_relative_to(root):
            raise RateError(f"{where}: {field} {value!r} is outside the folder") from None
        raise RateError(f"{where}: {field} {value} not found") from None
    if not p.is_relative_to(root):
        raise RateError(f"{where}: {field} {value!r} is outside the folder")
    if not p.is_file():
        raise RateError(f"{where}: {field} {value} is not a file")
    return p


def check_image(path: Path, where: str, field: str) -> tuple[int, int]:
    """The file decodes as a PNG of bounded size (what the app serves, as image/png); its (inode, size), read from
    the descriptor decoded, which the image server checks again before it serves the file."""
    import stat
    import warnings

    from PIL import Image as PILImage

    try:
        f = open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb")
    except OSError as e:
        raise RateError(f"{where}: {field} {path.name}: cannot be opened ({e.strerror})") from None
    with f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise RateError(f"{where}: {field} {path.name} is not a file")
        if st.st_size > MAX_IMAGE_BYTES:
            raise RateError(f"{where}: {field} {path.name}: over {MAX_IMAGE_BYTES >> 20} MiB")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", PILImage.DecompressionBombWarning)
                with PILImage.open(f) as im:
                    if im.format != "PNG":
                        raise RateError(f"{where}: {field} {path.name}: a {im.format} file, expected a PNG")
                    if im.width * im.height > MAX_IMAGE_PIXELS:
                        raise RateError(f"{where}: {field} {path.name}: {im.width}x{im.height} pixels, over "
                                        f"{MAX_IMAGE_PIXELS}")
                    im.load()
        except RateError:
            raise
        except Exception as e:  # noqa: BLE001 - Pillow raises many types for a file that is not an image
            raise RateError(f"{where}: {field} {path.name} is not a readable PNG ({type(e).__name__})") from None
    return st.st_ino, st.st_size


def _text(v, most: int) -> bool:
    """Text a database stores as it is: a str of 1..most characters, not blank, no NUL, no lone surrogate (JSON's
    "\\ud800" decodes to one; UTF-8 and PostgreSQL refuse it)."""
    if not isinstance(v, str) or not v.strip() or len(v) > most or "\x00" in v:
        return False
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_row(r, where: str) -> None:
    if not isinstance(r, dict):
        raise RateError(f"{where}: expected a JSON object")
    missing = [k for k in ("id", "prompt_id", "prompt", "task", "k", "image") if k not in r]
    if missing:
        raise RateError(f"{where}: missing {missing}")
    unknown = sorted(set(r) - set(PATH_FIELDS) - set(TEXT_FIELDS) - set(INT_FIELDS) - {"task"})
    if unknown:
        known = sorted(set(PATH_FIELDS) | set(TEXT_FIELDS) | set(INT_FIELDS) | {"task"})
        raise RateError(f"{where}: unknown key(s) {unknown}: a candidates line has {known}")
    for key, most in TEXT_FIELDS.items():
        v = r[key]
        if not _text(v, most):
            raise RateError(f"{where}: {key} {v!r:.80}: expected text of 1-{most} characters")
    for key in INT_FIELDS:
        v = r.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2 ** 63:
            raise RateError(f"{where}: {key} {v!r:.40}: expected an integer in [0, 2^63)")
    if r["task"] not in TASKS:
        raise RateError(f"{where}: task {r['task']!r:.40}: expected one of {TASKS}")
    if r.get("frames") is not None and not isinstance(r["frames"], list):
        raise RateError(f"{where}: frames: expected a list of paths")


def read_candidates(folder: str | Path) -> tuple[dict, list[dict]]:
    """(manifest, candidates) of a candidates folder, checked: every line parses, every path a line names (image,
    frames, source) is a PNG inside the folder, symlinks followed; each prompt has the manifest's K candidates, ids
    unique. Errors name the file and line."""
    d = Path(folder)
    root = d.resolve()
    mpath = d / "manifest.json"
    if not mpath.is_file():
        raise RateError(f"{d}: no manifest.json (a candidates folder is what 'difftrain candidates' writes)")
    confined(root, "manifest.json", str(d), "manifest.json")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise RateError(f"{mpath}: not JSON ({e})") from None
    if not isinstance(manifest, dict) or "k" not in manifest:
        raise RateError(f"{mpath}: expected an object with 'k', 'digest', 'prompts'")
    k = manifest["k"]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise RateError(f"{mpath}: k {k!r:.40}: expected an integer in [1, {MAX_K}]")
    cpath = d / "candidates.jsonl"
    if not cpath.is_file():
        raise RateError(f"{d}: no candidates.jsonl")
    confined(root, "candidates.jsonl", str(d), "candidates.jsonl")
    rows: list[dict] = []
    seen: dict[str, str] = {}
    try:
        text = cpath.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RateError(f"{cpath}: not UTF-8 text") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{cpath}:{n}"
        try:
            r = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise RateError(f"{where}: not JSON") from None
        _check_row(r, where)
        if r["id"] in seen:
            raise RateError(f"{where}: candidate id {r['id']!r} repeats {seen[r['id']]}")
        seen[r["id"]] = where
        paths, identity = [], {}
        for field, rel in [("image", r["image"])] + [("frames", f) for f in (r.get("frames") or [])]:
            p = confined(root, rel, where, field)
            identity[str(p)] = check_image(p, where, field)
            if field == "frames" or not r.get("frames"):
                paths.append(str(p))
        r["paths"] = paths
        r["source_path"] = ""
        if r["task"] == "edit":
            if not r.get("source"):
                raise RateError(f"{where}: an edit needs its source image ('source')")
            p = confined(root, r["source"], where, "source")
            identity[str(p)] = check_image(p, where, "source")
            r["source_path"] = str(p)
        elif r.get("source"):
            raise RateError(f"{where}: source {r['source']!r:.80}: only an edit has a source image")
        r["identity"] = identity
        rows.append(r)
    if not rows:
        raise RateError(f"{cpath}: no candidates")
    for pid, cands in _by_prompt(rows).items():
        if len(cands) != k:
            raise RateError(f"{cpath}: prompt {pid!r} has {len(cands)} candidates, the manifest's k is {k}")
        if sorted(c["k"] for c in cands) != list(range(k)):
            raise RateError(f"{cpath}: prompt {pid!r}: candidate numbers {sorted(c['k'] for c in cands)}, "
                            f"expected 0..{k - 1} once each")
    return manifest, rows


def _by_prompt(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["prompt_id"], []).append(r)
    for cands in out.values():
        cands.sort(key=lambda r: r["k"])
    return out


def _read_gold(path: str | Path | None, prompts: dict[str, list[dict]]) -> dict[str, list[str]]:
    """The gold file (JSONL of ``{"prompt_id": str, "order": [candidate id, best first, ...]}``), checked: every
    error is one line naming the file, the line and the field."""
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        raise RateError(f"--gold {p}: no such file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise RateError(f"{p}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise RateError(f"{p}: cannot be read ({e.strerror})") from None
    gold = {}
    shape = '{"prompt_id": "...", "order": [best, ...]}'
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            g = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise RateError(f"{where}: not JSON (expected {shape})") from None
        if not isinstance(g, dict):
            raise RateError(f"{where}: expected an object {shape}")
        unknown = sorted(set(g) - {"prompt_id", "order"})
        if unknown:
            raise RateError(f"{where}: unknown key(s) {[u[:40] for u in unknown[:5]]}: expected {shape}")
        pid, order = g.get("prompt_id"), g.get("order")
        if not _text(pid, TEXT_FIELDS["prompt_id"]):
            raise RateError(f"{where}: prompt_id {pid!r:.80}: expected text of 1-{TEXT_FIELDS['prompt_id']} "
                            "characters")
        if pid not in prompts:
            raise RateError(f"{where}: prompt_id {pid!r:.80} is not in the batch")
        ids = sorted(c["id"] for c in prompts[pid])
        if not isinstance(order, list) or not all(isinstance(c, str) for c in order) or sorted(order) != ids:
            raise RateError(f"{where}: order {order!r:.80}: expected a list naming each of the prompt's candidates "
                            f"once, best first: {ids}")
        if pid in gold:
            raise RateError(f"{where}: prompt_id {pid!r:.80} has a gold order already")
        gold[pid] = list(order)
    return gold


def import_batch(db: Database, name: str, folders: list[str], kind: str = "ranking", raters: int = 3,
                 gold_rate: float = 0.0, gold: str | None = None, questions: list[str] | None = None,
                 seed: int | None = None, min_raters: int | None = None,
                 stop_confidence: float | None = None) -> dict:
    """Import one folder (ranking or pairwise) or two (a comparison); returns what was made. With
    ``stop_confidence``, ``raters`` is the most an item gets and it stops at ``min_raters`` or more once its answers
    settle it (``stopping``)."""
    import random

    from difftrain_rate.stopping import check_settings

    if kind not in ("ranking", "pairwise"):
        raise RateError(f"--kind {kind!r}: expected 'ranking' or 'pairwise'")
    if not 1 <= len(folders) <= 2:
        raise RateError("a batch is one candidates folder, or two (a comparison of two checkpoints)")
    if isinstance(raters, bool) or not isinstance(raters, int) or not 1 <= raters <= MAX_RATERS:
        raise RateError(f"--raters {raters!r:.40}: expected an integer in [1, {MAX_RATERS}]")
    if not 0.0 <= gold_rate < 1.0:
        raise RateError(f"--gold-rate {gold_rate}: expected a share in [0, 1)")
    min_raters, stop_confidence = check_settings(raters, min_raters, stop_confidence)
    questions = list(questions or ["overall"])
    bad = [q for q in questions if q not in QUESTIONS]
    if bad or questions[0] != "overall":
        raise RateError(f"--questions {questions}: expected 'overall' first, then any of {QUESTIONS[1:]}")
    read = [read_candidates(f) for f in folders]
    prompts = [_by_prompt(rows) for _, rows in read]
    if len(folders) == 2:
        kind = "pairwise"
        a, b = prompts
        if set(a) != set(b) or any(len(a[p]) != len(b[p]) for p in a):
            raise RateError(f"{folders[0]} and {folders[1]}: a comparison needs the same prompts and K in both")
        seeds = [(c["noise_seed"] if "noise_seed" in c else None) for p in sorted(a) for c in a[p]]
        if seeds != [(c["noise_seed"] if "noise_seed" in c else None) for p in sorted(b) for c in b[p]]:
            raise RateError(f"{folders[0]} and {folders[1]}: a comparison needs the same noise seeds in both")
    gold_orders = _read_gold(gold, prompts[0]) if len(folders) == 1 else {}
    if gold and len(folders) == 2:
        raise RateError("--gold: a comparison has no known answers; add gold items to a one-folder batch")
    if gold_orders and gold_rate == 0.0:
        raise RateError("--gold given with --gold-rate 0: gold items would never be served")
    rng = random.Random(seed)
    with db.write() as s:
        if s.scalar(select(RatingBatch).where(RatingBatch.name == name)) is not None:
            raise RateError(f"a batch named {name!r} exists")
        models = [{k: m.get(k) for k in ("checkpoint", "step", "digest")} for m, _ in read]
        batch = RatingBatch(name=name, kind=kind, folders=[str(Path(f).resolve()) for f in folders], models=models,
                            raters=raters, gold_rate=gold_rate, questions=questions, status="open",
                            min_raters=min_raters, stop_confidence=stop_confidence)
        s.add(batch)
        s.flush()

        items = []

        def add(pid: str, cands: list[tuple[dict, int]], gold: list[str] | None) -> None:
            """One item showing ``cands`` ((candidate, model) each); ``gold``: its known order (candidate ids)."""
            first = cands[0][0]
            item = Item(id=opaque(), batch_id=batch.id, prompt_id=pid, prompt=first["prompt"], task=first["task"],
                        frames=len(first["paths"]), images=[], context=[], gold=None)
            views, handle = [], {}
            for c, model in cands:
                ids = []
                for path in c["paths"]:
                    ino, size = c["identity"][path]
                    img = Image(id=opaque(), batch_id=batch.id, item_id=item.id, path=path, candidate=c["id"],
                                model=model, inode=ino, size=size)
                    s.add(img)
                    ids.append(img.id)
                views.append(ids)
                handle[c["id"]] = ids[0]
            if first["source_path"]:
                ino, size = first["identity"][first["source_path"]]
                img = Image(id=opaque(), batch_id=batch.id, item_id=item.id, path=first["source_path"], candidate="",
                            model=0, inode=ino, size=size)
                s.add(img)
                item.context = [img.id]
            item.images = views
            if gold is not None:
                item.gold = [handle[cid] for cid in gold if cid in handle]
            items.append(item)

        for pid in sorted(prompts[0]):
            cands = prompts[0][pid]
            gold_order = gold_orders.get(pid)
            if len(folders) == 2:
                for ca, cb in zip(cands, prompts[1][pid]):
                    add(pid, [(ca, 0), (cb, 1)], None)
            elif kind == "ranking" or len(cands) == 2:
                add(pid, [(c, 0) for c in cands], gold_order)
            else:
                for x, y in combinations(cands, 2):
                    add(pid, [(x, 0), (y, 0)], gold_order)
        order = list(range(len(items)))
        rng.shuffle(order)                       # serving order: prompts interleaved, the same for every rater
        for seq, item in zip(order, items):
            item.seq = seq
        s.add_all(items)
        n_gold = sum(1 for i in items if i.gold is not None)
        return {"batch": name, "id": batch.id, "kind": kind, "items": len(items) - n_gold, "gold_items": n_gold,
                "raters": raters, **({"min_raters": min_raters, "stop_confidence": stop_confidence}
                                     if stop_confidence is not None else {})}
