"""Data sources -> raw samples: image references plus caption and scores, before any image is decoded.

A source is a table from ``[[data.sources]]``::

    {"name": "laion-a", "kind": "folder" | "manifest" | "webdataset" | "edit" | "keyframes",
     "path": "dir, file, glob or fsspec URI", "task": "t2i" | "edit" | "keyframes"  (optional)}

``iter_source`` validates the table (a bad one raises ``UserError`` at call time), lists the source
in a sorted, deterministic order and yields one ``RawSample`` per example. Images are only
*referenced* here (``refs``); ``refs.read_ref`` fetches their bytes later, and raises ``RefError`` for a
per-sample fault (a missing file, a truncated tar member) so a caller can skip and count it.

A ref is a local path, any fsspec URI (``memory://``, ``s3://``, ...) or ``SHARD.tar#member`` for a
member of an uncompressed tar shard.

Layouts, by kind:

* ``folder``     -- images (.png/.jpg/.jpeg/.webp) anywhere under ``path``; caption from a sidecar
  ``<stem>.txt`` (whole file, surrounding whitespace stripped) or ``<stem>.json`` (key ``caption``;
  its other numeric keys are scores). Key: the relative path without extension.
* ``manifest``   -- Parquet or JSONL file(s). t2i: columns ``image``, ``caption``; edit: ``source``,
  ``target``, ``instruction``; keyframes: ``frames`` (list) and ``caption``. Optional ``id`` (else
  the key is ``<file name>:<row>``); every other numeric column is a score. Relative image paths
  are resolved against the manifest's folder.
* ``webdataset`` -- .tar shards; members grouped by key (the member name up to the first dot of its
  base name), ``abc.png`` + ``abc.txt`` / ``abc.json``. For task edit: ``abc.source.png``,
  ``abc.target.png``, ``abc.instruction.txt``; for keyframes ``abc.frame_000.png``, ... + ``abc.txt``.
* ``edit``       -- ``<key>/source.png``, ``<key>/target.png``, ``<key>/instruction.txt``.
* ``keyframes``  -- ``<clip>/frame_000.png``, ``frame_001.png``, ... + ``<clip>/caption.txt``.

Both folder layouts (edit, keyframes) also read an optional ``<key>/scores.json`` of numeric scores.

Loss masks (``mask``, see ``mask_mode``): white (>= 128) where the loss is taken, black where it is not, the size
of the image it masks; ``NAME_mask.png`` beside a folder image, ``<key>/mask.png`` in an edit folder (the
target's mask), a manifest's ``mask`` column, or with ``mask = "alpha"`` the target image's alpha channel.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator

import fsspec

from difftrain.errors import UserError
from difftrain.data.prepare.refs import _has_magic, _split_tar_ref, _to_ref

TASKS: tuple[str, ...] = ("t2i", "edit", "keyframes")
KINDS: tuple[str, ...] = ("folder", "manifest", "webdataset", "edit", "keyframes")
IMAGE_EXTS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp")
# Tasks each kind can produce; the first is the default when the table has no "task".
KIND_TASKS: dict[str, tuple[str, ...]] = {
    "folder": ("t2i",),
    "manifest": ("t2i", "edit", "keyframes"),
    "webdataset": ("t2i", "edit", "keyframes"),
    "edit": ("edit",),
    "keyframes": ("keyframes",),
}
# Manifest columns that are not scores, whatever their type.
_RESERVED_COLUMNS = frozenset({"id", "image", "caption", "source", "target", "instruction", "frames", "key", "mask"})
_FRAME_RE = re.compile(r"frame_(\d+)$")
_MASK63 = (1 << 63) - 1
ALPHA = "@alpha"       # RawSample.mask: the target image's own alpha channel
MASK_MODES: tuple[str, ...] = ("auto", "alpha", "none")
MASK_SUFFIX = "_mask"  # folder kind: NAME_mask.png beside NAME.png is NAME's loss mask, never an image of its own




@dataclass
class RawSample:
    source: str
    key: str
    task: str
    refs: list[str]
    caption: str | None
    caption_error: str = ""
    scores: dict[str, float] = field(default_factory=dict)
    mask: str = ""        # the loss mask of the (target) image: a ref, ALPHA (its alpha channel) or "" (none)

    @property
    def sample_id(self) -> int:
        """Stable non-negative 63-bit id of ``(source, key)``."""
        digest = hashlib.blake2b(f"{self.source}\0{self.key}".encode("utf-8"), digest_size=8).digest()
        return int.from_bytes(digest, "big") & _MASK63




# --------------------------------------------------------------------------- captions and scores


def _numeric_scores(obj: dict[str, Any], skip: Iterable[str] = ()) -> dict[str, float]:
    skip = set(skip)
    out = {}
    for k, v in obj.items():
        if k in skip or v is None:
            continue
        if isinstance(v, (bool, int, float)):
            out[str(k)] = float(v)
    return out


def _decode_text(data: bytes) -> tuple[str | None, str]:
    """A caption file's text: UTF-8, a byte-order mark (which editors on Windows write first) dropped."""
    try:
        return data.decode("utf-8-sig").strip(), ""
    except UnicodeDecodeError:
        return None, "not UTF-8"


def _caption_from_json(data: bytes) -> tuple[str | None, str, dict[str, float]]:
    """(caption, caption_error, scores) from a JSON sidecar's bytes."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None, "not UTF-8", {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None, "bad JSON sidecar", {}
    if not isinstance(obj, dict):
        return None, "bad JSON sidecar", {}
    scores = _numeric_scores(obj, skip=("caption",))
    cap = obj.get("caption")
    if cap is None:
        return None, "missing caption", scores
    if not isinstance(cap, str):
        return None, "caption is not a string", scores
    return cap.strip(), "", scores


def _caption_from_sidecars(txt: bytes | None, js: bytes | None, txt_err: str = "",
                           js_err: str = "") -> tuple[str | None, str, dict[str, float]]:
    """A ``.txt`` sidecar gives the caption; a ``.json`` one gives scores (and the caption without a .txt)."""
    scores: dict[str, float] = {}
    cap, err = None, "missing sidecar"
    if js is not None:
        cap, err, scores = _caption_from_json(js)
    elif js_err:
        err = js_err
    if txt is not None:
        cap, err = _decode_text(txt)
    elif txt_err:
        cap, err = None, txt_err
    return cap, err, scores


# --------------------------------------------------------------------------- spec validation


def _spec_error(name: str, key: str, msg: str) -> UserError:
    return UserError(f"data.sources[{name!r}].{key}: {msg}")


def normalize_spec(spec: Any) -> Any:
    """A source table with the defaults a newcomer leaves out: ``kind = "folder"`` and, for one path, ``name`` = its
    last part (``{path = "my-photos"}`` is a folder source named ``my-photos``)."""
    if not isinstance(spec, dict):
        return spec
    out = dict(spec)
    out.setdefault("kind", "folder")
    path = out.get("path")
    if "name" not in out and isinstance(path, str) and path.strip("/"):
        out["name"] = posixpath.basename(path.rstrip("/")) or path
    return out


def _check_spec(spec: Any) -> tuple[str, str, Any, str]:
    if not isinstance(spec, dict):
        raise UserError(f"data.sources: each source must be a table, got {type(spec).__name__}")
    spec = normalize_spec(spec)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise UserError(f"data.sources: a source has no 'name' (expected a non-empty string), got {name!r}")
    kind = spec.get("kind")
    if kind not in KINDS:
        raise _spec_error(name, "kind", f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    path = spec.get("path")
    if kind == "manifest" and isinstance(path, (list, tuple)) and path and all(isinstance(p, str) and p for p in path):
        pass
    elif not isinstance(path, str) or not path:
        expected = "a file, a glob or a list of them" if kind == "manifest" else "a folder, file, glob or URI"
        raise _spec_error(name, "path", f"missing or empty; expected {expected}")
    task = spec.get("task", KIND_TASKS[kind][0])
    if task not in TASKS:
        raise _spec_error(name, "task", f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    if task not in KIND_TASKS[kind]:
        raise _spec_error(name, "task", f"kind {kind!r} cannot hold task {task!r}; "
                                        f"expected {' or '.join(KIND_TASKS[kind])}")
    return name, kind, path, task


def mask_mode(spec: dict) -> str:
    """A source's ``mask``: "auto" (default: a mask file where one is given -- ``NAME_mask.png`` beside a folder
    image, ``<key>/mask.png`` in an edit folder, a manifest's ``mask`` column), "alpha" (the target image's alpha
    channel) or "none". Masks are for the images a loss is taken on: text-to-image and edit targets."""
    name, _, _, task = _check_spec(spec)
    mode = normalize_spec(spec).get("mask", "auto")
    if mode not in MASK_MODES:
        raise _spec_error(name, "mask", f"unknown mask {mode!r}; expected one of {', '.join(MASK_MODES)}")
    if mode == "alpha" and task == "keyframes":
        raise _spec_error(name, "mask", "a keyframes source takes no mask (expected 'auto' or 'none')")
    return mode


def _expand(name: str, path: str, what: str) -> tuple[Any, list[str], str]:
    """(fs, matched paths, root the keys are relative to); UserError if nothing matches."""
    fs, stripped = fsspec.core.url_to_fs(path)
    if _has_magic(stripped):
        matched = sorted(fs.glob(stripped))
        static = re.split(r"[*?\[]", stripped, maxsplit=1)[0]
        root = static if static.endswith("/") else posixpath.dirname(static)
    else:
        matched = [stripped] if fs.exists(stripped) else []
        root = stripped if matched and fs.isdir(stripped) else posixpath.dirname(stripped)
    if not matched:
        raise _spec_error(name, "path", f"{path!r} matches nothing; expected {what}")
    return fs, matched, root.rstrip("/")


def _files_under(fs: Any, matched: list[str]) -> list[str]:
    files: set[str] = set()
    for m in matched:
        if fs.isdir(m):
            files.update(fs.find(m, withdirs=False))
        else:
            files.add(m)
    return sorted(files)


def _rel(path: str, root: str) -> str:
    if root and path.startswith(root + "/"):
        return path[len(root) + 1:]
    if root in ("", "/"):
        return path.lstrip("/")
    return posixpath.basename(path)


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def _split_ext(name: str) -> tuple[str, str]:
    stem, ext = posixpath.splitext(name)
    return stem, ext.lower()


def _cat(fs: Any, path: str) -> tuple[bytes | None, str]:
    try:
        return fs.cat_file(path), ""
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as e:
        return None, f"unreadable sidecar ({e.__class__.__name__})"


# --------------------------------------------------------------------------- kinds


def _mask_of(mode: str, found: str | None) -> str:
    return ALPHA if mode == "alpha" else (found or "") if mode == "auto" else ""


def _iter_folder(name: str, path: str, task: str, mode: str = "auto") -> Iterator[RawSample]:
    fs, matched, root = _expand(name, path, f"a folder of images ({', '.join(IMAGE_EXTS)})")
    files = _files_under(fs, matched)
    present = set(files)
    images = [p for p in files if _split_ext(p)[1] in IMAGE_EXTS and not _hidden(_rel(p, root))]
    bases = {_split_ext(p)[0] for p in images}
    masks = {_split_ext(p)[0][:-len(MASK_SUFFIX)]: p for p in images
             if _split_ext(p)[0].endswith(MASK_SUFFIX) and _split_ext(p)[0][:-len(MASK_SUFFIX)] in bases}
    images = [p for p in images if p not in set(masks.values())]
    if not images:
        raise _spec_error(name, "path", f"no images ({', '.join(IMAGE_EXTS)}) under {path!r}")
    stems: dict[str, int] = {}
    for p in images:
        stem = _split_ext(_rel(p, root))[0]
        stems[stem] = stems.get(stem, 0) + 1
    for p in images:
        rel = _rel(p, root)
        stem, ext = _split_ext(rel)
        key = stem if stems[stem] == 1 else stem + ext  # a.png next to a.jpg: keep both, distinctly
        base = _split_ext(p)[0]
        txt, txt_err = _cat(fs, base + ".txt") if base + ".txt" in present else (None, "")
        js, js_err = _cat(fs, base + ".json") if base + ".json" in present else (None, "")
        caption, err, scores = _caption_from_sidecars(txt, js, txt_err, js_err)
        found = _to_ref(fs, masks[base]) if base in masks else None
        yield RawSample(name, key, task, [_to_ref(fs, p)], caption, err, scores, _mask_of(mode, found))


def _dir_groups(name: str, path: str, what: str) -> tuple[Any, str, dict[str, dict[str, str]]]:
    """Files grouped by their parent folder (relative to the root): {key: {file name: full path}}."""
    fs, matched, root = _expand(name, path, what)
    if len(matched) == 1 and fs.isdir(matched[0]):
        root = matched[0].rstrip("/")
    groups: dict[str, dict[str, str]] = {}
    for p in _files_under(fs, matched):
        rel = _rel(p, root)
        if _hidden(rel) or "/" not in rel:
            continue
        key, fname = rel.rsplit("/", 1)
        groups.setdefault(key, {})[fname] = p
    return fs, root, groups


def _image_named(files: dict[str, str], stem: str) -> str | None:
    for ext in IMAGE_EXTS:
        if stem + ext in files:
            return files[stem + ext]
    return None


def _folder_scores(fs: Any, files: dict[str, str]) -> dict[str, float]:
    if "scores.json" not in files:
        return {}
    data, _ = _cat(fs, files["scores.json"])
    try:
        obj = json.loads(data.decode("utf-8-sig")) if data is not None else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return _numeric_scores(obj) if isinstance(obj, dict) else {}


def _iter_edit_folder(name: str, path: str, task: str, mode: str = "auto") -> Iterator[RawSample]:
    fs, root, groups = _dir_groups(name, path, "a folder of <key>/source.png, target.png, instruction.txt")
    keys = [k for k, files in groups.items()
            if _image_named(files, "source") or _image_named(files, "target") or "instruction.txt" in files]
    if not keys:
        raise _spec_error(name, "path", f"no edit triples (<key>/source.png, target.png, instruction.txt) "
                                        f"under {path!r}")
    for key in sorted(keys):
        files = groups[key]
        base = f"{root}/{key}"
        refs = [_image_named(files, "source") or f"{base}/source.png",
                _image_named(files, "target") or f"{base}/target.png"]
        if "instruction.txt" in files:
            data, read_err = _cat(fs, files["instruction.txt"])
            caption, err = _decode_text(data) if data is not None else (None, read_err or "missing sidecar")
        else:
            caption, err = None, "missing sidecar"
        found = _image_named(files, "mask")
        yield RawSample(name, key, task, [_to_ref(fs, r) for r in refs], caption, err, _folder_scores(fs, files),
                        _mask_of(mode, _to_ref(fs, found) if found else None))


def _frame_number(fname: str) -> int | None:
    stem, ext = _split_ext(fname)
    m = _FRAME_RE.fullmatch(stem)
    return int(m.group(1)) if m and ext in IMAGE_EXTS else None


def _iter_keyframes_folder(name: str, path: str, task: str) -> Iterator[RawSample]:
    fs, root, groups = _dir_groups(name, path, "a folder of <clip>/frame_000.png, ... + caption.txt")
    clips = {k: files for k, files in groups.items() if any(_frame_number(f) is not None for f in files)}
    if not clips:
        raise _spec_error(name, "path", f"no clips (<clip>/frame_000.png, ...) under {path!r}")
    for key in sorted(clips):
        files = clips[key]
        frames = sorted((n, fname) for fname in files if (n := _frame_number(fname)) is not None)
        refs = [_to_ref(fs, files[fname]) for _, fname in frames]
        if "caption.txt" in files:
            data, read_err = _cat(fs, files["caption.txt"])
            caption, err = _decode_text(data) if data is not None else (None, read_err or "missing sidecar")
        else:
            caption, err = None, "missing sidecar"
        yield RawSample(name, key, task, refs, caption, err, _folder_scores(fs, files))


# manifest ------------------------------------------------------------------


_MANIFEST_EXTS = (".parquet", ".jsonl")


def _manifest_files(name: str, path: str | list[str]) -> list[tuple[Any, str]]:
    out: list[tuple[Any, str]] = []
    for p in [path] if isinstance(path, str) else list(path):
        fs, matched, _ = _expand(name, p, "a Parquet (.parquet) or JSON-lines (.jsonl) manifest")
        for m in matched:
            cands = sorted(f for f in fs.find(m) if _split_ext(f)[1] in _MANIFEST_EXTS) if fs.isdir(m) else [m]
            for f in cands:
                if _split_ext(f)[1] not in _MANIFEST_EXTS:
                    raise _spec_error(name, "path", f"{_to_ref(fs, f)!r} is not a manifest; "
                                                    f"expected a .parquet or .jsonl file")
                out.append((fs, f))
    if not out:
        raise _spec_error(name, "path", f"{path!r} holds no .parquet or .jsonl manifest")
    return out


def _manifest_rows(name: str, fs: Any, path: str) -> Iterator[tuple[int, dict[str, Any], frozenset[str]]]:
    """(row index, row, numeric columns or empty meaning 'judge per row') for each row of a manifest."""
    ref = _to_ref(fs, path)
    if _split_ext(path)[1] == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            try:
                pf = pq.ParquetFile(f)
            except (pa.ArrowException, OSError) as e:
                raise _spec_error(name, "path", f"{ref}: not a readable Parquet file ({e})") from None
            numeric = frozenset(fld.name for fld in pf.schema_arrow
                                if pa.types.is_integer(fld.type) or pa.types.is_floating(fld.type)
                                or pa.types.is_boolean(fld.type))
            row = 0
            for batch in pf.iter_batches(batch_size=4096):
                for rec in batch.to_pylist():
                    yield row, rec, numeric
                    row += 1
        return
    with fs.open(path, "rb") as f:
        for lineno, raw in enumerate(f):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8-sig"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise _spec_error(name, "path", f"{ref}:{lineno + 1}: not a JSON object ({e})") from None
            if not isinstance(rec, dict):
                raise _spec_error(name, "path", f"{ref}:{lineno + 1}: expected a JSON object per line")
            yield lineno, rec, frozenset()


def _resolve(value: Any, fs: Any, manifest: str) -> str:
    """A manifest's image path as a ref: URIs and absolute paths as they are, the rest against its folder."""
    value = str(value)
    tar = _split_tar_ref(value)
    target = tar[0] if tar else value
    if "://" in target or target.startswith("/"):
        return value
    return _to_ref(fs, posixpath.normpath(posixpath.join(posixpath.dirname(manifest), value)))


_TASK_COLUMNS = {"t2i": ("image",), "edit": ("source", "target"), "keyframes": ("frames",)}
_CAPTION_COLUMN = {"t2i": "caption", "edit": "instruction", "keyframes": "caption"}


def _iter_manifest(name: str, path: str | list[str], task: str, mode: str = "auto") -> Iterator[RawSample]:
    files = _manifest_files(name, path)
    cap_col = _CAPTION_COLUMN[task]
    for fs, mpath in files:
        ref = _to_ref(fs, mpath)
        base = posixpath.basename(mpath)
        for row, rec, numeric in _manifest_rows(name, fs, mpath):
            where = f"{ref} row {row}" if not mpath.endswith(".jsonl") else f"{ref}:{row + 1}"
            for col in _TASK_COLUMNS[task]:
                if rec.get(col) is None:
                    raise _spec_error(name, "path", f"{where}: no {col!r}; a {task} manifest needs columns "
                                                    f"{', '.join(_TASK_COLUMNS[task] + (cap_col,))}")
            if task == "keyframes":
                frames = rec["frames"]
                if not isinstance(frames, (list, tuple)) or not frames:
                    raise _spec_error(name, "path", f"{where}: 'frames' must be a non-empty list of paths")
                refs = [_resolve(v, fs, mpath) for v in frames]
            else:
                refs = [_resolve(rec[c], fs, mpath) for c in _TASK_COLUMNS[task]]
            key = str(rec["id"]) if rec.get("id") is not None else f"{base}:{row}"
            cap = rec.get(cap_col)
            if cap is None:
                caption, err = None, f"missing {cap_col}"
            elif not isinstance(cap, str):
                caption, err = None, f"{cap_col} is not a string"
            else:
                caption, err = cap.strip(), ""
            if numeric:
                scores = {c: float(rec[c]) for c in numeric - _RESERVED_COLUMNS if rec.get(c) is not None}
            else:
                scores = _numeric_scores(rec, skip=_RESERVED_COLUMNS)
            found = _resolve(rec["mask"], fs, mpath) if task != "keyframes" and rec.get("mask") else None
            yield RawSample(name, key, task, refs, caption, err, scores, _mask_of(mode, found))


# webdataset ----------------------------------------------------------------


def _unique(name: str, samples: Iterator[RawSample]) -> Iterator[RawSample]:
    seen: set[str] = set()
    for s in samples:
        if s.key in seen:
            raise UserError(f"data.sources[{name!r}]: key {s.key!r} appears twice; keys must be unique "
                            f"within a source (they make the sample id)")
        seen.add(s.key)
        yield s


def iter_source(spec: dict, errors: list[str] | None = None) -> Iterator[RawSample]:
    """The raw samples of one ``[[data.sources]]`` table, in a deterministic order.

    The table is checked and the source listed now (a bad table raises ``UserError`` here); samples
    are produced lazily. A webdataset shard whose listing stops early (corrupt header, not a tar)
    still yields what it lists; the fault is appended to ``errors`` when a list is given, else a
    ``ShardError`` naming the shard is raised once every readable sample has been yielded.
    """
    spec = normalize_spec(spec)
    name, kind, path, task = _check_spec(spec)
    mode = mask_mode(spec)
    if kind == "folder":
        gen = _iter_folder(name, path, task, mode)
    elif kind == "manifest":
        gen = _iter_manifest(name, path, task, mode)
    elif kind == "webdataset":
        from difftrain.data.prepare.webdataset import _iter_webdataset, _shards

        _shards(name, path)  # validate now; the generator lists them again lazily
        gen = _iter_webdataset(name, path, task, errors)
        if mode == "alpha":
            gen = (replace(s, mask=ALPHA) for s in gen)
    elif kind == "edit":
        gen = _iter_edit_folder(name, path, task, mode)
    else:
        gen = _iter_keyframes_folder(name, path, task)
    if kind in ("folder", "edit", "keyframes"):
        first = next(gen, None)  # these list eagerly: surface a bad path at call time
        gen = _chain_first(first, gen)
    elif kind == "manifest":
        _manifest_files(name, path)
    return _unique(name, gen)


def _chain_first(first: RawSample | None, rest: Iterator[RawSample]) -> Iterator[RawSample]:
    if first is not None:
        yield first
        yield from rest


__all__ = ["TASKS", "KINDS", "IMAGE_EXTS", "RawSample", "RefError", "ShardError", "iter_source", "read_ref",
           "tar_ref"]
