"""Curation as Ray Data operations, for ``difftrain prepare``: the rules of ``curate.apply_filters``, row for
row, without the driver ever holding the rows.

- **Listing**: every ``[[data.sources]]`` table is listed in a read task of its own (``SourceListing``).
- **Facts** (size, content hash, perceptual hash, full decode) and the two checks that come first (a decode
  failure, then an unreadable caption) in map tasks.
- **Filters**, in the configured order: runs of per-row filters (size, area, aspect, caption, score) as one map;
  ``exact_dup`` as a sort on the content hash, each block holding whole hash groups, keeping the smallest
  sample id of a group's alive rows; ``near_dup`` as in ``near_dup.py`` (bounded work per row). Then a
  keyframe clip whose frame count is not ``data.frames`` is dropped.
- **The record** is written by Ray as Parquet parts into a folder beside the current record and swapped in
  only when the prepare succeeds (``StagedRecord``); counts per reason come from per-block tallies.

The driver holds counters: a tally per reason class, per table, per encoder actor.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from functools import partial
from typing import Any, Iterator

from difftrain.data.prepare.curate import RECORD_SIDECAR
from difftrain.errors import UserError

LIST_BLOCK_ROWS = 4096          # rows a facts task reads (a few seconds of work): a source spreads over the workers
RECORD_ROWS_PER_FILE = 100_000
RECORD_NAME = "curation.parquet"
_ROW_FILTERS = ("size", "area", "aspect", "caption", "score")


# --------------------------------------------------------------------------- listing

def _listing_schema():
    import pyarrow as pa
    return pa.schema([("sample_id", pa.int64()), ("source", pa.string()), ("key", pa.string()),
                      ("task", pa.string()), ("refs", pa.list_(pa.string())), ("caption", pa.string()),
                      ("caption_error", pa.string()), ("scores", pa.string()), ("mask", pa.string())])


def _list_source(spec: dict) -> Iterator[Any]:
    """One source's raw samples as Arrow blocks (in a Ray read task)."""
    import pyarrow as pa

    from difftrain.data.prepare.ingest import iter_source

    schema = _listing_schema()
    cols: dict[str, list] = {f.name: [] for f in schema}
    for s in iter_source(spec):
        for name, value in (("sample_id", s.sample_id), ("source", s.source), ("key", s.key), ("task", s.task),
                            ("refs", list(s.refs)), ("caption", s.caption), ("caption_error", s.caption_error),
                            ("scores", json.dumps(s.scores)), ("mask", s.mask)):
            cols[name].append(value)
        if len(cols["sample_id"]) >= LIST_BLOCK_ROWS:
            yield pa.table(cols, schema=schema)
            cols = {f.name: [] for f in schema}
    if cols["sample_id"]:
        yield pa.table(cols, schema=schema)


def _source_listing(specs: list[dict]):
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata

    class SourceListing(Datasource):
        """One read task per source: a source is listed in a deterministic order by ``ingest.iter_source``."""

        def estimate_inmemory_data_size(self):
            return None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            return [ReadTask(partial(_list_source, spec), BlockMetadata(None, None, None, None),
                             schema=_listing_schema()) for spec in specs]

    return SourceListing()


def local_path(path: str) -> str:
    """A local path made absolute (Ray workers do not share the driver's working directory); URIs as given."""
    return path if "://" in path else os.path.abspath(path)


def check_sources(cfg) -> list[dict]:
    """``[[data.sources]]`` checked on the driver (names, kinds, paths given), with local paths made absolute;
    the listing happens in Ray tasks."""
    from difftrain.data.prepare.ingest import _check_spec, mask_mode, normalize_spec

    if not cfg.data.sources:
        raise UserError("data.sources is empty: add [[data.sources]] tables {name, kind, path} to the config")
    given = [normalize_spec(s) for s in cfg.data.sources]
    names = [s.get("name") if isinstance(s, dict) else None for s in given]
    specs = []
    for spec in given:
        _, _, path, _ = _check_spec(spec)
        mask_mode(spec)
        specs.append(dict(spec, path=local_path(path) if isinstance(path, str) else [local_path(p) for p in path]))
    if len(set(names)) != len(names):
        raise UserError(f"data.sources: names must be unique, got {names}")
    return specs


# --------------------------------------------------------------------------- facts and per-row filters

def _facts_block(t):
    """Facts of every row, and the checks that come first: a decode failure, then an unreadable caption."""
    import pyarrow as pa

    from difftrain.data.prepare.curate import facts_for
    from difftrain.data.prepare.ingest import RawSample

    rows = t.to_pylist()
    out: dict[str, list] = {"width": [], "height": [], "sha256": [], "phash": [], "error": [], "reason": []}
    for r in rows:
        f = facts_for(RawSample(r["source"], r["key"], r["task"], r["refs"], r["caption"], r["caption_error"]))
        out["width"].append(f.width)
        out["height"].append(f.height)
        out["sha256"].append(f.sha256)
        out["phash"].append(f.phash)
        out["error"].append(f.error)
        out["reason"].append(f"decode: {f.error}" if f.error else
                             f"caption: {r['caption_error']}" if r["caption_error"] else "")
    types = {"width": pa.int32(), "height": pa.int32(), "sha256": pa.string(), "phash": pa.int64(),
             "error": pa.string(), "reason": pa.string()}
    for name, values in out.items():
        t = t.append_column(name, pa.array(values, types[name]))
    return t


def _set_reasons(t, reasons: list[str]):
    import pyarrow as pa
    return t.set_column(t.schema.get_field_index("reason"), "reason", pa.array(reasons, pa.string()))


def _row_filters_block(t, filters: list[dict]):
    """A run of per-row filters, in order: an alive row's reason is the first one it fails."""
    from difftrain.data.prepare.curate import Facts, _caption_reason, _score_reason, _size_reason

    reasons = t["reason"].to_pylist()
    cols = {name: t[name].to_pylist() for name in ("width", "height", "caption", "scores")}
    for i, r in enumerate(reasons):
        if r:
            continue
        facts = Facts(cols["width"][i], cols["height"][i], "", 0)
        for f in filters:
            if f["kind"] == "caption":
                r = _caption_reason(f, cols["caption"][i])
            elif f["kind"] == "score":
                r = _score_reason(f, json.loads(cols["scores"][i]))
            else:
                r = _size_reason(f, facts)
            if r:
                reasons[i] = r
                break
    return _set_reasons(t, reasons)


def _exact_dup_block(t):
    """(A block sorted by content hash: a hash group is never split.) Each group of alive rows keeps the
    smallest sample id; the others get ``exact_dup: <kept id>``."""
    reasons = t["reason"].to_pylist()
    ids, sha = t["sample_id"].to_pylist(), t["sha256"].to_pylist()
    source, key = t["source"].to_pylist(), t["key"].to_pylist()
    first: dict[str, int] = {}
    for i in sorted((i for i, r in enumerate(reasons) if not r), key=lambda i: (ids[i], source[i], key[i])):
        keep = first.setdefault(sha[i], i)
        if keep != i:
            reasons[i] = f"exact_dup: {ids[keep]}"
    return _set_reasons(t, reasons)


def _frames_block(t, frames: int):
    """A kept keyframe clip must have ``data.frames`` frames (a table has one frame count)."""
    reasons = t["reason"].to_pylist()
    tasks, refs = t["task"].to_pylist(), t["refs"].to_pylist()
    for i, r in enumerate(reasons):
        if not r and tasks[i] == "keyframes" and len(refs[i]) != frames:
            reasons[i] = f"frames: expected {frames} (data.frames), got {len(refs[i])}"
    return _set_reasons(t, reasons)


def curated_dataset(cfg, specs: list[dict]) -> tuple[Any, dict]:
    """Every input row of the sources ``specs`` (``check_sources``) with its facts and reason ("" = kept), lazily
    where it can be (a near_dup filter materialises the rows in the object store), and the near-duplicate work
    done."""
    import ray.data

    from difftrain.data.prepare.curate import check_filters
    from difftrain.data.prepare.near_dup import WINDOW, near_dup_dataset, sorted_by

    filters = check_filters(cfg.data.filters)
    ds = (ray.data.read_datasource(_source_listing(specs), override_num_blocks=len(specs))
          .repartition(target_num_rows_per_block=LIST_BLOCK_ROWS))     # a source's rows spread over the facts tasks
    ds = ds.map_batches(_facts_block, batch_size=32, batch_format="pyarrow")
    run: list[dict] = []
    stats: dict[str, Any] = {}

    def flush(ds):
        if run:
            ds = ds.map_batches(_row_filters_block, fn_kwargs={"filters": list(run)}, batch_format="pyarrow")
            run.clear()
        return ds

    for f in filters:
        if f["kind"] in _ROW_FILTERS:
            run.append(f)
            continue
        ds = flush(ds)
        if f["kind"] == "exact_dup":
            ds = sorted_by(ds, "sha256").map_batches(_exact_dup_block, batch_size=None, batch_format="pyarrow")
        else:
            ds, stats["near_dup"] = near_dup_dataset(ds, f["distance"], f.get("window", WINDOW))
    ds = flush(ds)
    ds = ds.map_batches(_frames_block, fn_kwargs={"frames": cfg.data.frames}, batch_format="pyarrow")
    return ds, stats


# --------------------------------------------------------------------------- counts

def _tally_block(t, words: bool):
    """Rows per reason class and, with ``words``, the distinct words of the kept captions (kind, value, n)."""
    import pyarrow as pa

    from difftrain.data.prepare.curate import reason_class
    from difftrain.words import words_of

    reasons = t["reason"].to_pylist()
    c = Counter("kept" if not r else reason_class(r) for r in reasons)
    kinds, values, ns = ["reason"] * len(c), list(c), list(c.values())
    if words:
        vocab: set[str] = set()
        for caption, r in zip(t["caption"].to_pylist(), reasons):
            if not r:
                vocab.update(words_of(caption or ""))
        kinds += ["word"] * len(vocab)
        values += sorted(vocab)
        ns += [0] * len(vocab)
    return pa.table({"kind": kinds, "value": pa.array(values, pa.string()), "n": pa.array(ns, pa.int64())})


def reason_tally(ds, words: bool = False) -> tuple[dict[str, int], set[str]]:
    """({"kept": n, "<reason class>": n, ...} most frequent first, the words of the kept captions if ``words``):
    per-block tallies merged on the driver."""
    total: Counter = Counter()
    vocab: set[str] = set()
    for batch in ds.map_batches(_tally_block, fn_kwargs={"words": words}, batch_size=None,
                                batch_format="pyarrow").iter_batches(batch_size=None, batch_format="pyarrow"):
        for kind, value, n in zip(batch["kind"].to_pylist(), batch["value"].to_pylist(), batch["n"].to_pylist()):
            if kind == "reason":
                total[value] += n
            else:
                vocab.add(value)
    return dict(sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))), vocab


# --------------------------------------------------------------------------- the record

def _record_block(t):
    """The record's columns: the outcome; width, height, hash and phash empty where the image was not read."""
    import pyarrow as pa
    import pyarrow.compute as pc

    failed = pc.not_equal(t["error"], "")
    t = t.append_column("outcome", pc.if_else(pc.equal(t["reason"], ""), "kept", "dropped"))
    for name in ("width", "height"):
        t = t.set_column(t.schema.get_field_index(name), name,
                         pc.if_else(pc.equal(t[name], 0), pa.scalar(None, pa.int32()), t[name]))
    t = t.set_column(t.schema.get_field_index("sha256"), "sha256",
                     pc.if_else(pc.equal(t["sha256"], ""), pa.scalar(None, pa.string()), t["sha256"]))
    t = t.set_column(t.schema.get_field_index("phash"), "phash",
                     pc.if_else(failed, pa.scalar(None, pa.int64()), t["phash"]))
    return t


class StagedRecord:
    """The curation record of one prepare, written beside ``STORE/curation.parquet`` and swapped in only when
    the prepare succeeds: a failed or killed prepare leaves the previous record as it was.

    On a local (or mounted) store the swap is two renames; a crash between them leaves the previous record
    under ``.curation.parquet.old-*``, which the next prepare puts back. On an object store the swap copies
    the parts once the prepare has succeeded."""

    def __init__(self, store: str):
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(store)
        self.root = root.rstrip("/")
        tag = f"{os.getpid()}-{time.time_ns()}"
        self.final = f"{self.root}/{RECORD_NAME}"
        self.path = f"{self.root}/.{RECORD_NAME}.new-{tag}"
        self.old = f"{self.root}/.{RECORD_NAME}.old-{tag}"
        self.uri = self.path if self._local else self.fs.unstrip_protocol(self.path)
        self.done = False

    @property
    def _local(self) -> bool:
        proto = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        return "file" in proto

    def recover(self) -> None:
        """Put back a record a crash left mid-swap; remove parts that killed runs left behind."""
        if not self.fs.exists(self.root):
            return
        leftovers = [p for p in self.fs.ls(self.root, detail=False)
                     if os.path.basename(p.rstrip("/")).startswith((f".{RECORD_NAME}.new-", f".{RECORD_NAME}.old-"))]
        olds = sorted(p for p in leftovers if f".{RECORD_NAME}.old-" in p)
        if olds and not self.fs.exists(self.final):
            self.fs.mv(olds[-1], self.final, recursive=True)
            leftovers.remove(olds[-1])
        for p in leftovers:
            self.fs.rm(p, recursive=True)

    def write(self, ds, extra: dict) -> None:
        """Ray writes the record as Parquet parts; ``extra`` goes in a sidecar that ``read_record`` attaches."""
        self.fs.makedirs(self.path, exist_ok=True)
        ds.map_batches(_record_block, batch_format="pyarrow").write_parquet(
            self.uri, min_rows_per_file=RECORD_ROWS_PER_FILE)
        self.fs.pipe_file(f"{self.path}/{RECORD_SIDECAR}", json.dumps(extra, sort_keys=True, default=str).encode())

    def publish(self, name: str = RECORD_NAME) -> str:
        """Swap the parts in as ``STORE/<name>``; the record it replaces is removed once the swap is done."""
        final = f"{self.root}/{name}"
        had = self.fs.exists(final)
        if had:
            self.fs.mv(final, self.old, recursive=True)
        self.fs.mv(self.path, final, recursive=True)
        if had:
            self.fs.rm(self.old, recursive=True)
        self.done = True
        return final if self._local else self.fs.unstrip_protocol(final)

    def discard(self) -> None:
        if not self.done and self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)


# --------------------------------------------------------------------------- errors raised in Ray tasks

# Ray Data appends its retry note to the message of an exception a task raised
# (ray.data._internal.util._annotate_exception_with_retry_context): "\nFailed to ... after 1/1 attempts ...".
_RAY_RETRY_NOTE = re.compile(r"\nFailed to .* after \d+/\d+ attempts \(total backoff .*", re.DOTALL)


def user_error_in(exc: BaseException) -> UserError | None:
    """The UserError a Ray task raised (Ray wraps it with the task's traceback), with its own message only."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        if isinstance(e, UserError) and not isinstance(cause, BaseException):
            return UserError(_RAY_RETRY_NOTE.sub("", str(e)))
        todo += [cause if isinstance(cause, BaseException) else None, e.__cause__, e.__context__]
    return None


__all__ = ["local_path", "check_sources", "curated_dataset", "reason_tally", "StagedRecord", "user_error_in"]
