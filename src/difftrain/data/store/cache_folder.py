"""The node cache's folder: what it holds and how the processes of a node share it (``node_cache.py`` copies).

Layout of ``data.cache_dir``:

    .lock                                      the cache-wide lock (``fcntl.flock``), held for bookkeeping only
    .tmp/<unit>.part                           a copy in progress, ``flock``-ed by its copier, files preallocated
    <stage>__<bucket>__<task>@v<v>.lance/      a table at version v: what opens it, and the installed fragments
        _versions/<v's manifest>, _deletions/, _indices/
        data/<stem>.lance, data/<stem>/*.blob

Every change of state (a claim, an install, an eviction, removing an orphan) happens under the cache-wide lock.
A claim creates the unit's temporary copy with every file preallocated to its size, so the bytes of the folder,
summed under the lock, bound what it will hold. An install is a rename: the metadata folder at once, a
fragment's blob folder before its ``.lance`` file, which marks it installed. The kernel releases a dead
process's flocks, so a temporary copy nobody holds is a killed copier's and may be removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

LOCK_TIMEOUT_S = 30.0                 # the lock is held for bookkeeping only: longer than this is a fault


@dataclass
class Layout:
    """A table at one version as the cache sees it: each fragment's first row (in the order ``take`` counts rows)
    and data file stems; the store's files and their sizes are listed when first copied."""
    name: str
    uri: str
    version: int
    bounds: np.ndarray                    # bounds[i] is fragment i's first row; bounds[-1] the row count
    stems: list[list[str]]
    files: dict[str, int] | None = None   # path relative to the table -> size
    marks: dict = field(default_factory=dict)   # unit -> the paths marking it installed, as strings

    @property
    def folder(self) -> str:
        return f"{self.name.replace('/', '__')}@v{self.version}.lance"

    def key(self, frag: int | None) -> str:
        """The unit's name among temporary copies."""
        return f"{self.folder[:-len('.lance')]}.{'meta' if frag is None else self.stems[frag][0]}"

    def unit_files(self, frag: int | None) -> dict[str, int]:
        """Files of fragment ``frag`` (None: the metadata), relative to the table, with their sizes. The metadata
        is what Lance reads to open version v (checked with pylance 14): its manifest, the deletion and index
        files; not the other versions' manifests nor ``_transactions/`` (a table committed every 256 rows has
        thousands)."""
        assert self.files is not None
        if frag is None:
            manifests = {f"_versions/{self.version}.manifest", f"_versions/{2**64 - 1 - self.version}.manifest"}
            return {p: s for p, s in self.files.items() if p in manifests or p.startswith(("_deletions/", "_indices/"))}
        out = {}
        for stem in self.stems[frag]:
            out.update({p: s for p, s in self.files.items()
                        if p == f"data/{stem}.lance" or p.startswith(f"data/{stem}/")})
        return out


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (a file or a folder)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except FileNotFoundError:
                pass
    return total


def try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None if another open file holds it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _preallocate(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if size and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)          # ENOSPC now, not halfway through the copy
        else:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


@dataclass
class Claim:
    """A unit this process copies: its temporary copy and the fd holding its flock."""
    key: str
    tmp: Path
    fd: int


class CacheFolder:
    """The folder's state as the processes of a node share it. Raises OSError where the folder fails."""

    def __init__(self, directory: Path, limit: float, count):
        self.dir, self.limit, self.count = directory, limit, count
        self.tmp = directory / ".tmp"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(exist_ok=True)
        self._lock_fd: int | None = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        self._threads = threading.Lock()             # a flock is per open file: this process's threads queue here
        self._known: set[str] = set()                # paths of units seen installed

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @contextmanager
    def locked(self):
        """The cache-wide lock, with a timeout: a stuck holder makes the cache give up, not the run hang."""
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        if self._lock_fd is None or not self._threads.acquire(timeout=LOCK_TIMEOUT_S):
            raise TimeoutError(f"{self.dir / '.lock'}: not available within {LOCK_TIMEOUT_S:.0f} s")
        try:
            while True:
                try:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self.dir / '.lock'} held for over {LOCK_TIMEOUT_S:.0f} s") from None
                    time.sleep(0.002)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            self._threads.release()

    def marker(self, lay: Layout, frag: int | None) -> list[str]:
        """What marks a unit installed: the table's folder, or the fragment's ``.lance`` files."""
        marks = lay.marks.get(frag)
        if marks is None:
            folder = os.path.join(self.dir, lay.folder)
            marks = lay.marks[frag] = [folder] if frag is None else \
                [os.path.join(folder, "data", f"{s}.lance") for s in lay.stems[frag]]
        return marks

    def installed(self, lay: Layout, frag: int | None, fresh: bool = False) -> bool:
        """Whether a unit is installed. What was seen installed is remembered, so that scanning a window costs no
        system call; a read or a claim (``fresh``) looks again, and forgets what another process evicted."""
        for path in self.marker(lay, frag):
            if not fresh and path in self._known:
                continue
            if not os.path.exists(path):
                self._known.discard(path)
                return False
            self._known.add(path)
        return True

    def stamp(self, lay: Layout, frag: int) -> None:
        """Mark an installed fragment as wanted now (its mtime orders eviction, least recently wanted first)."""
        try:
            os.utime(self.marker(lay, frag)[0])
        except OSError:
            pass

    # ---- under the lock --------------------------------------------------------------------------
    def claim(self, lay: Layout, frag: int | None, files: dict[str, int], keep) -> Claim | str:
        """Claim a unit to copy (call under the lock): a Claim with every file preallocated, or 'installed',
        'busy' (another process or thread copies it) or 'full' (no room even after evicting what ``keep()``
        does not protect). A temporary copy nobody holds is a killed copier's: it is removed."""
        if self.installed(lay, frag, fresh=True):
            return "installed"
        key = lay.key(frag)
        tmp = self.tmp / f"{key}.part"
        if tmp.exists():
            fd = try_lock(tmp)
            if fd is None:
                return "busy"
            shutil.rmtree(tmp)
            os.close(fd)
            self.count("stale_temps_removed")
        if not self.make_room(sum(files.values()), keep):
            return "full"
        tmp.mkdir()
        fd = try_lock(tmp)
        assert fd is not None, "a fresh temporary copy is ours under the lock"
        try:
            if frag is None:
                (tmp / "data").mkdir()
            for rel, size in files.items():
                dst = tmp / self.temp_path(rel, frag)
                dst.parent.mkdir(parents=True, exist_ok=True)
                _preallocate(dst, size)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            os.close(fd)
            raise
        return Claim(key, tmp, fd)

    @staticmethod
    def temp_path(rel: str, frag: int | None) -> str:
        """Where a file of the table (``rel``) lies in a unit's temporary copy."""
        return rel if frag is None else rel[len("data/"):]

    def install(self, lay: Layout, frag: int | None, claim: Claim) -> None:
        """Rename a copied unit into place (under the lock): the metadata folder at once; a fragment's blob
        folders, then its ``.lance`` files."""
        folder = self.dir / lay.folder
        if frag is None:
            os.rename(claim.tmp, folder)
        else:
            data = folder / "data"
            for stem in lay.stems[frag]:
                if (claim.tmp / stem).is_dir():
                    shutil.rmtree(data / stem, ignore_errors=True)      # an orphan of an interrupted eviction
                    os.rename(claim.tmp / stem, data / stem)
            for stem in lay.stems[frag]:
                os.rename(claim.tmp / f"{stem}.lance", data / f"{stem}.lance")
            shutil.rmtree(claim.tmp)
        os.close(claim.fd)

    def discard(self, claim: Claim) -> None:
        """Remove an unfinished copy; where the folder fails, leave it as a killed copier's would be."""
        try:
            with self.locked():
                shutil.rmtree(claim.tmp, ignore_errors=True)
        except (OSError, TimeoutError):
            pass
        os.close(claim.fd)

    def make_room(self, need: int, keep) -> bool:
        """Whether ``need`` more bytes fit under the limit, after removing orphaned temporary copies, then the
        least recently wanted fragments, then metadata folders left without data; never what ``keep()``
        returns (folders and (folder, stem) pairs this process wants) nor a table a copy is being made for."""
        used = tree_bytes(self.dir)
        if used + need <= self.limit:
            return True
        keep_tables, keep_frags = keep()
        orphans, frags, metas = [], [], []
        for t in self.tmp.iterdir():
            fd = try_lock(t)
            if fd is not None:
                os.close(fd)
                orphans.append([t])
        claims = [t.name for t in self.tmp.iterdir()]
        for folder in self.dir.glob("*.lance"):
            data = folder / "data"
            markers = list(data.glob("*.lance")) if data.is_dir() else []
            for m in markers:
                if (folder.name, m.stem) not in keep_frags:
                    frags.append((m.stat().st_mtime, [m, data / m.stem]))
            for d in data.iterdir() if data.is_dir() else []:
                if d.is_dir() and not (data / f"{d.name}.lance").exists():
                    orphans.append([d])                 # the blob folder of an interrupted eviction
            prefix = folder.name[:-len(".lance")] + "."
            if not markers and folder.name not in keep_tables and not any(c.startswith(prefix) for c in claims):
                metas.append((folder.stat().st_mtime, [folder]))
        victims = [("stale_temps_removed", paths) for paths in orphans]
        victims += [("evicted_units", paths) for _, paths in sorted(frags, key=lambda e: e[0])]
        victims += [("evicted_units", paths) for _, paths in sorted(metas, key=lambda e: e[0])]
        for counter, paths in victims:
            freed = 0
            for p in paths:                             # a fragment's .lance file first: readers see it gone
                self._known.discard(str(p))
                if p.exists():
                    freed += tree_bytes(p)
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            used -= freed
            self.count(counter)
            if counter == "evicted_units":
                self.count("evicted_bytes", freed)
            if used + need <= self.limit:
                return True
        return False


def is_full_disk(err: BaseException) -> bool:
    return getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
