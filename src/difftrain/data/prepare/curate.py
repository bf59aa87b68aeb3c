"""Curation: per-sample facts read from the images, ordered filters that say why a sample is dropped,
and the curation record (one Parquet row per input sample, kept or not, with its reason).

Filters come from ``[[data.filters]]`` and run in the given order; a sample's reason is the first
filter it fails. Two checks always come first: an image that cannot be read or decoded
(``"decode: ..."``), then a caption the source could not produce (``"caption: missing sidecar"``).
Deduplication filters only see samples kept so far, and keep the sample with the smallest
``sample_id`` of each group, so the outcome does not depend on the input order.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import posixpath
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from difftrain.data.prepare.ingest import RawSample
from difftrain.data.prepare.refs import RefError, read_ref
from difftrain.data.prepare.near_dup import WINDOW, bands, near_dup_keepers
from difftrain.errors import UserError

_U64 = (1 << 64) - 1
_SCORE_PREFIX = "score_"
RECORD_META_KEY = b"difftrain.curation"
RECORD_SIDECAR = "_difftrain.json"      # a record folder's extra (readers of Parquet parts skip "_" files)


@dataclass
class Facts:
    width: int
    height: int
    sha256: str
    phash: int
    error: str = ""


# --------------------------------------------------------------------------- facts


def _phash_int(img: Any) -> int:
    """imagehash.phash as a signed 64-bit int (bit 63 of the row-major hash is the sign)."""
    import imagehash

    bits = np.asarray(imagehash.phash(img).hash, dtype=bool).reshape(-1)
    value = 0
    for b in bits:
        value = (value << 1) | int(b)
    return value - (1 << 64) if value >= 1 << 63 else value


def phash_of_array(img: np.ndarray) -> int:
    """The 64-bit phash (signed int) of an (H, W, 3) uint8 array, as ``facts_for`` computes it."""
    from PIL import Image

    return _phash_int(Image.fromarray(np.asarray(img, dtype=np.uint8)))


def hamming(a: int, b: int) -> int:
    """Bits that differ between two 64-bit hashes (signed or unsigned ints)."""
    return ((a ^ b) & _U64).bit_count()


def _ref_label(task: str, i: int, n: int) -> str:
    if task == "edit" and n == 2:
        return ("source", "target")[i]
    if task == "keyframes":
        return f"frame {i}"
    return "image" if n == 1 else f"image {i}"


def _decode(data: bytes) -> Any:
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()  # decode every pixel now: a truncated file fails here, not later in a loader
    return img


def facts_for(sample: RawSample) -> Facts:
    """Read and fully decode a sample's images; per-sample faults land in ``Facts.error``."""
    n = len(sample.refs)
    if n == 0:
        return Facts(0, 0, "", 0, "no image references")
    first_target = 1 if sample.task == "edit" and n > 1 else 0
    digests: list[bytes] = []
    sizes: list[tuple[int, int]] = []
    target_img = None
    for i, ref in enumerate(sample.refs):
        label = _ref_label(sample.task, i, n)
        try:
            data = read_ref(ref)
        except RefError as e:
            return Facts(0, 0, "", 0, f"{label}: {e}")
        digests.append(hashlib.sha256(data).digest())
        try:
            img = _decode(data)
        except Exception as e:  # noqa: BLE001 -- any decoder failure is this sample's fault, not the run's
            msg = str(e).split("\n")[0] or e.__class__.__name__
            if e.__class__.__name__ == "UnidentifiedImageError":
                msg = "not a recognised image format"
            return Facts(0, 0, "", 0, f"{label}: {ref}: {msg}")
        sizes.append(img.size)
        if i == first_target:
            target_img = img
    w, h = sizes[first_target]
    # One image: the file's own sha256 (what sha256sum prints); several: the sha256 of their digests.
    sha = digests[0].hex() if n == 1 else hashlib.sha256(b"".join(digests)).hexdigest()
    try:
        ph = _phash_int(target_img)
    except Exception as e:  # noqa: BLE001
        return Facts(w, h, sha, 0, f"{_ref_label(sample.task, first_target, n)}: cannot hash ({e})")
    if len(set(sizes)) > 1:
        listing = ", ".join(f"{a}x{b}" for a, b in sizes)
        what = "frames" if sample.task == "keyframes" else "images"
        return Facts(w, h, sha, ph, f"{what} of different sizes ({listing})")
    return Facts(w, h, sha, ph)


# --------------------------------------------------------------------------- filter specs

_FILTER_KEYS: dict[str, dict[str, tuple[type, ...]]] = {
    "size": {"min_side": (int, float), "max_side": (int, float)},
    "area": {"min": (int, float), "max": (int, float)},
    "aspect": {"min": (int, float), "max": (int, float)},
    "caption": {"min_words": (int,), "max_words": (int,), "max_chars": (int,)},
    "exact_dup": {},
    "near_dup": {"distance": (int,), "window": (int,)},
    "score": {"column": (str,), "min": (int, float), "max": (int, float)},
}
_REQUIRED = {"near_dup": ("distance",), "score": ("column",)}


def _filter_error(i: int, key: str, msg: str) -> UserError:
    return UserError(f"data.filters[{i}].{key}: {msg}")


def check_filters(filters: Sequence[dict]) -> list[dict]:
    """Validate ``[[data.filters]]`` tables; UserError names the filter index and key."""
    if not isinstance(filters, (list, tuple)):
        raise UserError(f"data.filters: expected a list of tables, got {type(filters).__name__}")
    out = []
    for i, f in enumerate(filters):
        if not isinstance(f, dict):
            raise UserError(f"data.filters[{i}]: expected a table, got {type(f).__name__}")
        kind = f.get("kind")
        if kind not in _FILTER_KEYS:
            raise _filter_error(i, "kind", f"unknown filter kind {kind!r}; expected one of {', '.join(_FILTER_KEYS)}")
        allowed = _FILTER_KEYS[kind]
        for key, value in f.items():
            if key == "kind":
                continue
            if key not in allowed:
                hint = f"expected one of {', '.join(allowed)}" if allowed else "it takes no options"
                raise _filter_error(i, key, f"unknown key for a {kind!r} filter; {hint}")
            if isinstance(value, bool) or not isinstance(value, allowed[key]):
                want = "a string" if allowed[key] == (str,) else "an integer" if allowed[key] == (int,) else "a number"
                raise _filter_error(i, key, f"expected {want}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise _filter_error(i, key, f"expected a finite number, got {value!r}")
            if kind != "score" and not isinstance(value, str) and value < 0:
                raise _filter_error(i, key, f"expected a value >= 0, got {value!r}")
        for key in _REQUIRED.get(kind, ()):
            if key not in f:
                raise _filter_error(i, key, f"missing; a {kind!r} filter needs it")
        if kind == "near_dup" and not 0 <= f["distance"] <= 31:
            raise _filter_error(i, "distance", f"expected 0..31 bits, got {f['distance']}")
        if kind == "near_dup" and f.get("window", 1) < 1:
            raise _filter_error(i, "window", f"expected at least 1 comparison, got {f['window']}")
        if kind == "score" and "min" not in f and "max" not in f:
            raise _filter_error(i, "min", "a 'score' filter needs 'min', 'max' or both")
        for lo, hi in (("min", "max"), ("min_side", "max_side"), ("min_words", "max_words")):
            if lo in f and hi in f and f[lo] > f[hi]:
                raise _filter_error(i, lo, f"{lo} = {f[lo]} is above {hi} = {f[hi]}")
        out.append(dict(f))
    return out


# --------------------------------------------------------------------------- per-sample filters


def _fmt(x: float) -> str:
    return f"{x:g}"


def _size_reason(f: dict, facts: Facts) -> str:
    w, h = facts.width, facts.height
    if f["kind"] == "size":
        if "min_side" in f and min(w, h) < f["min_side"]:
            return "size: min_side"
        if "max_side" in f and max(w, h) > f["max_side"]:
            return "size: max_side"
    elif f["kind"] == "area":
        if "min" in f and w * h < f["min"]:
            return "area: min"
        if "max" in f and w * h > f["max"]:
            return "area: max"
    elif f["kind"] == "aspect":
        ratio = w / h if h else math.inf
        if "min" in f and ratio < f["min"]:
            return "aspect: min"
        if "max" in f and ratio > f["max"]:
            return "aspect: max"
    return ""


def _caption_reason(f: dict, caption: str | None) -> str:
    if caption is None or "\ufffd" in caption or "\x00" in caption:
        return "caption: undecodable"
    if not caption.strip():
        return "caption: empty"
    words = len(caption.split())
    if "min_words" in f and words < f["min_words"]:
        return "caption: too short"
    if ("max_words" in f and words > f["max_words"]) or ("max_chars" in f and len(caption) > f["max_chars"]):
        return "caption: too long"
    return ""


def _score_reason(f: dict, scores: dict[str, float]) -> str:
    col = f["column"]
    value = scores.get(col)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"score: {col} missing"
    if "min" in f and value < f["min"]:
        return f"score: {col} < {_fmt(f['min'])}"
    if "max" in f and value > f["max"]:
        return f"score: {col} > {_fmt(f['max'])}"
    return ""


# --------------------------------------------------------------------------- dedup


def near_dup_pairs(hashes: Sequence[int], distance: int) -> list[tuple[int, int]]:
    """Every index pair (i < j) whose 64-bit hashes differ in at most ``distance`` bits.

    Pigeonhole: split the bits into ``distance + 1`` bands; two hashes within ``distance`` agree
    exactly on at least one band, so only hashes sharing a band value are compared.
    """
    vals = [h & _U64 for h in hashes]
    pairs: set[tuple[int, int]] = set()
    for b, (shift, mask) in enumerate(bands(distance)):
        buckets: dict[int, list[int]] = {}
        for i, v in enumerate(vals):
            buckets.setdefault((v >> shift) & mask, []).append(i)
        for members in buckets.values():
            for x in range(len(members)):
                for y in range(x + 1, len(members)):
                    i, j = members[x], members[y]
                    if (i, j) not in pairs and (vals[i] ^ vals[j]).bit_count() <= distance:
                        pairs.add((i, j))
    return sorted(pairs)


def _order(samples: Sequence[RawSample], idx: Iterable[int], ids: Sequence[int]) -> list[int]:
    return sorted(idx, key=lambda i: (ids[i], samples[i].source, samples[i].key))


def _exact_dup(samples: Sequence[RawSample], facts: Sequence[Facts], alive: list[int],
               ids: Sequence[int]) -> dict[int, str]:
    first: dict[str, int] = {}
    dropped: dict[int, str] = {}
    for i in _order(samples, alive, ids):
        keep = first.setdefault(facts[i].sha256, i)
        if keep != i:
            dropped[i] = f"exact_dup: {ids[keep]}"
    return dropped


def _near_dup(samples: Sequence[RawSample], facts: Sequence[Facts], alive: list[int], ids: Sequence[int],
              distance: int, window: int) -> dict[int, str]:
    """In sample_id order, a sample within ``distance`` of an already kept one is dropped (reason: the smallest
    such kept id), over the pairs the bounded candidate search of ``near_dup`` finds (the rule prepare runs)."""
    keepers, _ = near_dup_keepers([ids[i] for i in alive], [facts[i].phash for i in alive], distance, window)
    return {i: f"near_dup: {k}" for i, k in zip(alive, keepers.tolist()) if k >= 0}


# --------------------------------------------------------------------------- apply


def apply_filters(samples: Sequence[RawSample], facts: Sequence[Facts],
                  filters: Sequence[dict]) -> list[tuple[bool, str]]:
    """``(kept, reason)`` per sample, in input order; reason is "" for a kept sample."""
    filters = check_filters(filters)
    if len(samples) != len(facts):
        raise ValueError(f"{len(samples)} samples but {len(facts)} facts")
    reasons: list[str] = [""] * len(samples)
    for i, (s, fc) in enumerate(zip(samples, facts)):
        if fc.error:
            reasons[i] = f"decode: {fc.error}"
        elif s.caption_error:
            reasons[i] = f"caption: {s.caption_error}"
    ids = [s.sample_id for s in samples]
    for f in filters:
        alive = [i for i, r in enumerate(reasons) if not r]
        kind = f["kind"]
        if kind in ("size", "area", "aspect"):
            for i in alive:
                reasons[i] = _size_reason(f, facts[i])
        elif kind == "caption":
            for i in alive:
                reasons[i] = _caption_reason(f, samples[i].caption)
        elif kind == "score":
            for i in alive:
                reasons[i] = _score_reason(f, samples[i].scores)
        elif kind == "exact_dup":
            for i, r in _exact_dup(samples, facts, alive, ids).items():
                reasons[i] = r
        elif kind == "near_dup":
            for i, r in _near_dup(samples, facts, alive, ids, f["distance"], f.get("window", WINDOW)).items():
                reasons[i] = r
    return [(not r, r) for r in reasons]


def reason_class(reason: str) -> str:
    """A reason without its per-sample detail: dedup reasons lose the kept id, decode reasons the message."""
    head = reason.split(":", 1)[0]
    return head if head in ("exact_dup", "near_dup", "decode") else reason


def reason_counts(outcomes: Iterable[tuple[bool, str]]) -> dict[str, int]:
    """{"kept": n, "<reason class>": n, ...}, most frequent first (ties by name)."""
    c = Counter("kept" if kept else reason_class(reason) for kept, reason in outcomes)
    return dict(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


# --------------------------------------------------------------------------- record

_FIXED_COLUMNS = ("sample_id", "source", "key", "task", "refs", "caption", "caption_error", "width", "height",
                  "mask", "sha256", "phash", "error", "outcome", "reason")


def score_column(name: str) -> str:
    """The record column of a score: its own name, or ``score_<name>`` if that is a fixed column."""
    return _SCORE_PREFIX + name if name in _FIXED_COLUMNS else name


def write_record(path: str | os.PathLike, samples: Sequence[RawSample], facts: Sequence[Facts],
                 outcomes: Sequence[tuple[bool, str]], extra: dict | None = None) -> None:
    """Write the curation record (one row per input sample) as Parquet, atomically: a local path via a
    temporary file and a rename, an fsspec URI (``s3://``, ``memory://``...) as one upload.

    ``extra`` (JSON-serialisable: the filters, the sources, counts...) is stored in the schema metadata
    under ``difftrain.curation``; ``record_extra`` reads it back.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not len(samples) == len(facts) == len(outcomes):
        raise ValueError(f"record needs one fact and one outcome per sample: "
                         f"{len(samples)} samples, {len(facts)} facts, {len(outcomes)} outcomes")
    score_names = sorted({k for s in samples for k in s.scores})
    cols: dict[str, pa.Array] = {
        "sample_id": pa.array([s.sample_id for s in samples], pa.int64()),
        "source": pa.array([s.source for s in samples], pa.string()),
        "key": pa.array([s.key for s in samples], pa.string()),
        "task": pa.array([s.task for s in samples], pa.string()),
        "refs": pa.array([list(s.refs) for s in samples], pa.list_(pa.string())),
        "caption": pa.array([s.caption for s in samples], pa.string()),
        "caption_error": pa.array([s.caption_error for s in samples], pa.string()),
        "width": pa.array([fc.width if fc.width else None for fc in facts], pa.int32()),
        "height": pa.array([fc.height if fc.height else None for fc in facts], pa.int32()),
        "sha256": pa.array([fc.sha256 or None for fc in facts], pa.string()),
        "phash": pa.array([None if fc.error else fc.phash for fc in facts], pa.int64()),
        "error": pa.array([fc.error for fc in facts], pa.string()),
        "outcome": pa.array(["kept" if k else "dropped" for k, _ in outcomes], pa.string()),
        "reason": pa.array([r for _, r in outcomes], pa.string()),
    }
    for name in score_names:
        cols[score_column(name)] = pa.array([s.scores.get(name) for s in samples], pa.float64())
    table = pa.table(cols)
    meta = {RECORD_META_KEY: json.dumps(extra or {}, sort_keys=True, default=str).encode("utf-8")}
    table = table.replace_schema_metadata(meta)
    target = os.fspath(path)
    if "://" in target and not target.startswith("file://"):
        # Object stores publish an upload only once it completes, which is what the rename buys locally.
        import fsspec

        buf = pa.BufferOutputStream()
        pq.write_table(table, buf)
        fs, fpath = fsspec.core.url_to_fs(target)
        fs.makedirs(posixpath.dirname(fpath), exist_ok=True)
        fs.pipe_file(fpath, buf.getvalue().to_pybytes())
        return
    out = Path(target[len("file://"):] if target.startswith("file://") else target)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_record(path: str | os.PathLike) -> Any:
    """The curation record (a local path or an fsspec URI) as a ``pyarrow.Table``: one Parquet file
    (``write_record``) or a folder of Parquet parts (``difftrain prepare``, whose ``extra`` sidecar
    ``RECORD_SIDECAR`` comes back in the schema metadata)."""
    import fsspec
    import pyarrow.parquet as pq

    target = os.fspath(path)
    fs, fpath = fsspec.core.url_to_fs(target)
    if fs.isdir(fpath):
        table = pq.read_table(fpath, filesystem=fs)          # files named "_*" or ".*" are not parts
        sidecar = f"{fpath.rstrip('/')}/{RECORD_SIDECAR}"
        if fs.isfile(sidecar):
            table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                                   RECORD_META_KEY: fs.cat_file(sidecar)})
        return table
    if not fs.isfile(fpath):
        raise UserError(f"{target}: curation record not found")
    with fs.open(fpath, "rb") as f:
        return pq.read_table(f)


def record_extra(table: Any) -> dict:
    """The ``extra`` dict that ``write_record`` stored with a record."""
    meta = table.schema.metadata or {}
    raw = meta.get(RECORD_META_KEY)
    return json.loads(raw.decode("utf-8")) if raw else {}


__all__ = ["Facts", "facts_for", "phash_of_array", "hamming", "check_filters", "apply_filters", "near_dup_pairs",
           "reason_class", "reason_counts", "write_record", "read_record", "record_extra", "score_column"]
