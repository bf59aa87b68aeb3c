"""Image references and reading them: a ref is a local path, any fsspec URI (``memory://``, ``s3://``, ...) or
``SHARD.tar#member`` for a member of an uncompressed tar shard. ``read_ref`` fetches a ref's bytes and raises
``RefError`` for a per-sample fault (a missing file, a truncated tar member), so a caller can skip and count it;
tar shards are indexed once (member offsets, an LRU of indexes) and read by span. ``ShardError``: a shard whose
listing stopped early or that is not a tar."""

from __future__ import annotations

import os
import tarfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import fsspec

from difftrain.errors import UserError

class RefError(ValueError):
    """An image reference that cannot be read: a per-sample fault, not a bad config."""


class ShardError(UserError):
    """A webdataset shard whose listing stopped early (a corrupt header) or that is not a tar at all."""


def _has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def _to_ref(fs: Any, path: str) -> str:
    """How a listed file is referenced: a plain path on the local disk, a full URI elsewhere."""
    if _is_local(fs):
        return path
    return fs.unstrip_protocol(path)


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def _split_tar_ref(ref: str) -> tuple[str, str] | None:
    """``("shard.tar", "member")`` for a tar-member ref, else None (a '#' elsewhere is part of a path)."""
    pos = ref.find("#")
    while pos != -1:
        if ref[:pos].lower().endswith(".tar"):
            return ref[:pos], ref[pos + 1:]
        pos = ref.find("#", pos + 1)
    return None


def tar_ref(shard: str, member: str) -> str:
    """The ref of one member of a tar shard."""
    return f"{shard}#{member}"


def read_ref(ref: str) -> bytes:
    """The bytes a ref points at; raises RefError (naming the ref) when they cannot be read."""
    parts = _split_tar_ref(ref)
    if parts is not None:
        return _read_tar_member(*parts)
    try:
        if "://" in ref:
            with fsspec.open(ref, "rb") as f:
                return f.read()
        with open(ref, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise RefError(f"{ref}: file not found") from None
    except IsADirectoryError:
        raise RefError(f"{ref}: is a directory, expected a file") from None
    except (OSError, ValueError) as e:
        raise RefError(f"{ref}: cannot read ({e.__class__.__name__}: {e})") from None


# --------------------------------------------------------------------------- tar shards


@dataclass
class _TarIndex:
    members: "OrderedDict[str, tuple[int, int]]"  # name -> (data offset, size), in shard order
    total: int  # shard size in bytes
    error: str = ""  # why the listing stopped early (members are missing), "" when it reached the end
    note: str = ""  # a fault confined to one member (the file ends inside its data)


_TAR_CACHE: "OrderedDict[tuple, _TarIndex]" = OrderedDict()
_TAR_CACHE_SIZE = 64
_TAR_LOCK = threading.Lock()


def _open_binary(ref: str) -> Any:
    return fsspec.open(ref, "rb").open() if "://" in ref else open(ref, "rb")


def _tar_cache_key(shard: str) -> tuple:
    if "://" in shard and not shard.startswith("file://"):
        return (shard,)
    try:
        st = os.stat(shard[len("file://"):] if shard.startswith("file://") else shard)
        return (shard, st.st_size, st.st_mtime_ns)  # a rewritten shard is listed again
    except OSError:
        return (shard,)


def _scan_tar(shard: str) -> _TarIndex:
    """List a shard's regular-file members from its headers; never raises for a damaged shard."""
    members: OrderedDict[str, tuple[int, int]] = OrderedDict()
    try:
        f = _open_binary(shard)
    except FileNotFoundError:
        return _TarIndex(members, 0, f"{shard}: shard not found")
    except OSError as e:
        return _TarIndex(members, 0, f"{shard}: cannot open shard ({e})")
    with f:
        total = f.seek(0, 2)
        f.seek(0)
        try:
            tf = tarfile.open(fileobj=f, mode="r:")
        except tarfile.TarError as e:
            return _TarIndex(members, total, f"{shard}: not a readable tar ({e})")
        stopped = ""
        last = None
        try:
            for info in tf:
                if info.isfile():
                    members[info.name] = (info.offset_data, info.size)
                    last = info.name
        except tarfile.TarError as e:
            stopped = str(e)
        if last is not None and sum(members[last]) > total:
            return _TarIndex(members, total, note=f"{shard}: the file ends inside member {last!r} "
                                                  f"(truncated shard)")
        if stopped:
            return _TarIndex(members, total, f"{shard}: listing stopped at byte {tf.offset} ({stopped}); "
                                             f"members after it are missing")
        # tarfile stops quietly at an invalid header that is not the first one: tell that apart
        # from a proper end (end-of-archive zero blocks, or the end of the file).
        end = tf.offset
        if end < total:
            f.seek(end)
            if f.read(tarfile.BLOCKSIZE).strip(b"\0"):
                return _TarIndex(members, total, f"{shard}: corrupt tar header at byte {end}; "
                                                 f"members after it are missing")
    return _TarIndex(members, total)


def _tar_index(shard: str) -> _TarIndex:
    key = _tar_cache_key(shard)
    with _TAR_LOCK:
        if key in _TAR_CACHE:
            _TAR_CACHE.move_to_end(key)
            return _TAR_CACHE[key]
    index = _scan_tar(shard)
    with _TAR_LOCK:
        _TAR_CACHE[key] = index
        while len(_TAR_CACHE) > _TAR_CACHE_SIZE:
            _TAR_CACHE.popitem(last=False)
    return index


def _read_span(f: Any, shard: str, member: str, offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise RefError(f"{shard}#{member}: truncated tar member (expected {size} bytes, shard holds {len(data)})")
    return data


def _read_tar_member(shard: str, member: str) -> bytes:
    index = _tar_index(shard)
    if member not in index.members:
        why = f"; the shard's listing is incomplete: {index.error}" if index.error else ""
        raise RefError(f"{shard}#{member}: no such member in the shard{why}")
    offset, size = index.members[member]
    try:
        with _open_binary(shard) as f:
            return _read_span(f, shard, member, offset, size)
    except RefError:
        raise
    except (OSError, ValueError) as e:
        raise RefError(f"{shard}#{member}: cannot read tar member ({e.__class__.__name__}: {e})") from None
