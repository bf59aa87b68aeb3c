"""Webdataset sources: ``.tar`` shards listed once, their members grouped by key (the member name up to the first dot
of its base name) into raw samples; a shard whose listing stops early is a ``ShardError`` reported per shard."""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Iterator

from difftrain.data.prepare.ingest import (IMAGE_EXTS, RawSample, _caption_from_sidecars, _expand, _hidden,
                                           _spec_error)
from difftrain.data.prepare.refs import (RefError, ShardError, _open_binary, _read_span, _TarIndex, _tar_index, _to_ref,
                                        tar_ref)
def _shards(name: str, path: str) -> list[str]:
    fs, matched, _ = _expand(name, path, "a .tar shard, a glob of them or a folder of them")
    shards = []
    for m in matched:
        if fs.isdir(m):
            shards += sorted(f for f in fs.find(m) if f.lower().endswith(".tar"))
        elif m.lower().endswith(".tar"):
            shards.append(m)
        else:
            raise _spec_error(name, "path", f"{_to_ref(fs, m)!r} is not an uncompressed .tar shard")
    if not shards:
        raise _spec_error(name, "path", f"no .tar shards under {path!r}")
    return [_to_ref(fs, s) for s in shards]


def _wds_key(member: str) -> tuple[str, str]:
    """webdataset convention: 'dir/abc.seg.png' -> ('dir/abc', 'seg.png')."""
    head, _, base = member.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{head}/{stem}" if head else stem
    return key, ext.lower() if dot else ""


def _wds_image(exts: dict[str, str], prefix: str = "") -> str | None:
    for ext in IMAGE_EXTS:
        if prefix + ext[1:] in exts:
            return exts[prefix + ext[1:]]
    return None


def _iter_shard(name: str, shard: str, task: str, index: _TarIndex) -> Iterator[RawSample]:
    groups: OrderedDict[str, dict[str, str]] = OrderedDict()
    for member in index.members:
        key, ext = _wds_key(member)
        if ext and not _hidden(key):
            groups.setdefault(key, {})[ext] = member
    try:
        f = _open_binary(shard)
    except OSError:
        f = None

    def member_bytes(member: str | None) -> tuple[bytes | None, str]:
        if member is None:
            return None, ""
        if f is None:
            return None, "unreadable sidecar (shard cannot be opened)"
        offset, size = index.members[member]
        try:
            return _read_span(f, shard, member, offset, size), ""
        except (RefError, OSError, ValueError):
            return None, "unreadable sidecar (truncated tar member)"

    try:
        for key, exts in groups.items():
            if task == "t2i":
                image = _wds_image(exts)
                if image is None:
                    continue
                refs = [tar_ref(shard, image)]
                txt, txt_err = member_bytes(exts.get("txt"))
            elif task == "edit":
                src, tgt = _wds_image(exts, "source."), _wds_image(exts, "target.")
                if src is None and tgt is None:
                    continue
                refs = [tar_ref(shard, src or f"{key}.source.png"), tar_ref(shard, tgt or f"{key}.target.png")]
                txt, txt_err = member_bytes(exts.get("instruction.txt", exts.get("txt")))
            else:
                frames = sorted((int(m.group(1)), member) for ext, member in exts.items()
                                if (m := re.fullmatch(r"frame_(\d+)\.(png|jpe?g|webp)", ext)))
                if not frames:
                    continue
                refs = [tar_ref(shard, member) for _, member in frames]
                txt, txt_err = member_bytes(exts.get("txt"))
            js, js_err = member_bytes(exts.get("json"))
            caption, err, scores = _caption_from_sidecars(txt, js, txt_err, js_err)
            yield RawSample(name, key, task, refs, caption, err, scores)
    finally:
        if f is not None:
            f.close()


def _iter_webdataset(name: str, path: str, task: str, errors: list[str] | None) -> Iterator[RawSample]:
    problems: list[str] = []
    for shard in _shards(name, path):
        index = _tar_index(shard)
        yield from _iter_shard(name, shard, task, index)
        if index.note and errors is not None:
            errors.append(f"source {name!r}: {index.note}")
        if index.error:
            problems.append(index.error)
            if errors is not None:
                errors.append(f"source {name!r}: {index.error}")
    if problems and errors is None:
        raise ShardError(f"data.sources[{name!r}]: {len(problems)} damaged shard(s); the samples they still "
                         f"list were yielded: " + "; ".join(problems))


# --------------------------------------------------------------------------- entry point
