"""The node-local cache in front of the shared latent store: Lance fragments copied ahead of the plan.

**What is cached, and the unit.** The local copy of table T at version v is a folder
``CACHE/<stage>__<bucket>__<task>@v<v>.lance`` holding what Lance reads to open version v (its manifest in
``_versions/``, ``_deletions/``, ``_indices/``; not the other versions nor ``_transactions/``: a table committed
every 256 rows has thousands; installed first, in one rename) and the data files of the fragments installed so far: ``data/<stem>.lance`` and, for latents over 64 KiB, the fragment's blob sidecar
folder ``data/<stem>/``. The unit is one fragment. Lance opens a fragment's files only when a row of it is read
(checked with pylance 14), so a dataset opened on that folder at version v serves the rows of the installed
fragments; the loader reads the others from the shared store (``split``) and merges by sample id.

**One copy per node.** The processes sharing the folder coordinate through it. Under a cache-wide lock
(``CACHE/.lock``, ``fcntl.flock``, held only for bookkeeping, never while copying) a copier claims a unit by
creating its temporary copy ``CACHE/.tmp/<unit>.part`` with every file preallocated to its size, and holds an
``flock`` on it while it copies; it installs the unit by ``rename`` under the lock (a fragment's ``.lance`` file
last: a fragment is installed when that file exists). A unit whose temporary copy is locked is being copied by
another process: it is read from the shared store until installed. A temporary copy nobody holds is a killed
copier's (the kernel drops a dead process's locks): the next copier of that unit, or one making room, removes it.
Readers only open installed files.

**The bound.** ``data.cache_gb`` bounds the bytes of every file under the folder, temporary copies included: a
claim sums the folder under the lock and makes room by removing orphaned temporary copies, then the least
recently wanted fragments (their ``.lance`` file's mtime, set when the fragment enters a process's lookahead)
that this process does not need within its lookahead, then metadata folders left without data. A unit that does
not fit is not copied (its rows are read from the store).

**Fallback.** A cache folder that cannot be created, is not writable or whose disk is full: one warning, the
error counted (``cache_errors``, ``disabled``), no more copies; reads go to the shared store. Never a crash: the
lock is taken with a timeout, and a failed local read is read again from the store.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("difftrain")

CHUNK = 8 << 20                       # bytes a store read call asks for
LOCK_TIMEOUT_S = 30.0                 # the cache-wide lock is held for bookkeeping only; longer means a fault
BUSY_POLL_S = 0.05                    # how often a unit another process copies is looked at again
COPY_THREADS = 4                      # copies in flight per process: a network store's latency is hidden
STALL_ENV = "DIFFTRAIN_CACHE_STALL_S"  # test hook: every fragment copy pauses this long halfway


def store_fs(uri: str):
    """The fsspec filesystem and root path of a store table. The cache copies through it (bench/loader.py wraps it
    to model a slow network store)."""
    import fsspec
    return fsspec.core.url_to_fs(uri)


class _StoreError(Exception):
    """Reading the shared store failed (not the cache's fault: the unit is given up, the cache goes on)."""


class _Closed(Exception):
    pass


@dataclass
class _Layout:
    """A table at one version as the cache sees it: the first row of each fragment (in the order ``take`` counts
    rows) and each fragment's data file stems; the store's files and sizes are listed on the first copy."""
    name: str
    uri: str
    version: int
    bounds: np.ndarray                    # bounds[i] is fragment i's first row; bounds[-1] the row count
    stems: list[list[str]]
    files: dict[str, int] | None = None   # path relative to the table -> size

    @property
    def folder(self) -> str:
        return f"{self.name.replace('/', '__')}@v{self.version}.lance"

    def unit_files(self, frag: int | None) -> dict[str, int]:
        """Files of fragment ``frag`` (None: the metadata), relative to the table, with their sizes."""
        assert self.files is not None
        if frag is None:            # what Lance reads to open version v: its manifest, deletion and index files
            manifests = {f"_versions/{self.version}.manifest", f"_versions/{2**64 - 1 - self.version}.manifest"}
            return {p: s for p, s in self.files.items() if p in manifests or p.startswith(("_deletions/", "_indices/"))}
        out = {}
        for stem in self.stems[frag]:
            out.update({p: s for p, s in self.files.items()
                        if p == f"data/{stem}.lance" or p.startswith(f"data/{stem}/")})
        return out


def _size(path: Path) -> int:
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


def _try_lock(path: Path) -> int | None:
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
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


class NodeCache:
    """Copies the fragments a loader will read into a node-local folder shared by the node's processes."""

    def __init__(self, directory: str, limit_bytes: float, tables: dict[str, tuple[str, object]]):
        self.dir, self.limit = Path(directory), float(limit_bytes)
        self.tmp = self.dir / ".tmp"
        self._tables = tables                          # name -> (store uri, the store dataset at its version)
        self._layouts: dict[str, _Layout] = {}
        self._local: dict[str, object] = {}            # name -> Lance dataset opened on the local copy
        self._mutex = threading.Lock()                 # layouts, local datasets, counters
        self._cond = threading.Condition()
        self._window: list[tuple[str, int]] = []
        self._gen = 0                                  # bumped on every change of the window
        self._done_gen = -1                            # the window the copier last found nothing left to do in
        self._given_up: set[tuple[str, int | None]] = set()
        self._pending = 0                              # lookahead requests not yet turned into a window
        self._known: set[str] = set()                  # paths of units seen installed
        self.closed = False
        self.disabled: str | None = None
        self.stall = float(os.environ.get(STALL_ENV, "0") or 0)
        self.copied: list[str] = []                    # units this process copied (tests count copies)
        self.counts = {"units_copied": 0, "bytes_copied": 0, "copy_s": 0.0, "stale_temps_removed": 0,
                       "evicted_units": 0, "evicted_bytes": 0, "not_fitting": 0, "met_copying_elsewhere": 0,
                       "copy_errors": 0, "cache_errors": 0, "local_read_failures": 0}
        self._lock_fd: int | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.tmp.mkdir(exist_ok=True)
            self._lock_fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self._fail(e, "cannot be created or written")
        self._inflight: set[str] = set()               # units this process's copiers hold
        self._tlock = threading.Lock()                 # the cache-wide flock is per open file: threads queue here
        self._threads = [threading.Thread(target=self._run, name=f"difftrain-cache-{i}", daemon=True)
                         for i in range(COPY_THREADS if self.disabled is None else 0)]
        for t in self._threads:
            t.start()

    # ---- the loader's side -----------------------------------------------------------------------
    def layout(self, name: str) -> _Layout:
        with self._mutex:
            lay = self._layouts.get(name)
            if lay is None:
                uri, ds = self._tables[name]
                frags = ds.get_fragments()
                counts = [f.count_rows() for f in frags]     # as the loader's index counts rows
                bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
                stems = [[Path(df.path).stem for df in f.metadata.files] for f in frags]
                lay = self._layouts[name] = _Layout(name, uri, ds.version, bounds, stems)
        return lay

    def fragments(self, name: str, rows: np.ndarray) -> list[int]:
        """The fragments holding ``rows`` (dataset row numbers), in the order the rows first meet them."""
        frag = np.searchsorted(self.layout(name).bounds, rows, side="right") - 1
        _, first = np.unique(frag, return_index=True)
        return frag[np.sort(first)].tolist()

    def want(self, units: list[tuple[str, int]]) -> None:
        """The fragments (table, fragment index) this process reads next, first needed first: the copier fetches
        them in this order, and they are not evicted by this process. A fragment entering the window is
        stamped as recently wanted (its mtime), for every process's LRU eviction."""
        seen: set[tuple[str, int]] = set()
        window = [u for u in units if not (u in seen or seen.add(u))]
        with self._cond:
            if window == self._window:
                return
            new = set(window) - set(self._window)
            idle = self._done_gen == self._gen
            self._window, self._gen = window, self._gen + 1
            if idle and all(self._installed(self.layout(n), f) for n, f in new):
                self._done_gen = self._gen              # nothing to copy: the copiers sleep on
            else:
                self._cond.notify_all()
        for name, frag in new:
            lay = self.layout(name)
            for stem in lay.stems[frag][:1]:
                try:
                    os.utime(self.dir / lay.folder / "data" / f"{stem}.lance")
                except OSError:
                    pass

    def split(self, name: str, rows: np.ndarray):
        """(a Lance dataset on the local copy, or None; a mask of the ``rows`` whose fragment is installed)."""
        lay = self.layout(name)
        frag = np.searchsorted(lay.bounds, rows, side="right") - 1
        local = [f for f in np.unique(frag).tolist() if self._installed(lay, f, fresh=True)]
        if not local:
            return None, np.zeros(len(rows), dtype=bool)
        ds = self._local_ds(lay)
        if ds is None:
            return None, np.zeros(len(rows), dtype=bool)
        return ds, np.isin(frag, local)

    def read_failed(self, name: str, err: Exception) -> None:
        """A read of the local copy failed (a fragment evicted meanwhile by another process): read from the store."""
        with self._mutex:
            self.counts["local_read_failures"] += 1
        log.debug("node cache: a local read of %s failed (%s); read from the store", name, err)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the copier has nothing left to do for the current window; True if all of it is installed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while ((self._pending or self._done_gen != self._gen or self._inflight) and self.disabled is None
                   and not self.closed):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            window = list(self._window)
        return all(self._installed(self.layout(n), f, fresh=True) for n, f in window)

    def stats(self) -> dict:
        with self._mutex:
            out = dict(self.counts)
        out["disabled"] = self.disabled
        return out

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=60)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- local state -----------------------------------------------------------------------------
    def _installed(self, lay: _Layout, frag: int | None, fresh: bool = False) -> bool:
        """Whether a unit is installed: its metadata folder, or its fragment's ``.lance`` files. What was seen
        installed is remembered, so that the copier's scans of its window cost no system call; reads (``fresh``)
        and claims look again, and forget what another process evicted."""
        paths = [self.dir / lay.folder] if frag is None else \
            [self.dir / lay.folder / "data" / f"{s}.lance" for s in lay.stems[frag]]
        for path in paths:
            key = str(path)
            if not fresh and key in self._known:
                continue
            if not path.exists():
                self._known.discard(key)
                return False
            self._known.add(key)
        return True

    def _local_ds(self, lay: _Layout):
        with self._mutex:
            ds = self._local.get(lay.name)
        if ds is None:
            import lance
            try:
                ds = lance.dataset(str(self.dir / lay.folder), version=lay.version)
            except Exception as e:  # noqa: BLE001 - the store still serves every row
                self.read_failed(lay.name, e)
                return None
            with self._mutex:
                ds = self._local.setdefault(lay.name, ds)
        return ds

    def _fail(self, err: OSError | TimeoutError, what: str) -> None:
        """A fault of the cache folder: one warning, counted; no more copies (reads go to the store)."""
        with self._mutex:
            self.counts["cache_errors"] += 1
            first = self.disabled is None
            if first:
                self.disabled = f"{what}: {err}"
        if first:
            hint = ("free the disk or lower data.cache_gb below its free space"
                    if getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) else
                    "data.cache_dir must be a node-local folder this process can create and write")
            log.warning("node cache %s %s (%s); training reads the shared store instead (%s)",
                        self.dir, what, err, hint)

    @contextmanager
    def _locked(self):
        """The cache-wide lock, with a timeout: a stuck holder makes the cache give up, not the run hang."""
        if self._lock_fd is None:
            raise OSError(errno.EBADF, "no lock file")
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        if not self._tlock.acquire(timeout=LOCK_TIMEOUT_S):
            raise TimeoutError(f"{self.dir / '.lock'}: waited over {LOCK_TIMEOUT_S:.0f} s")
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
            self._tlock.release()

    # ---- the copier ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if self.closed:
                    return
                window, gen = list(self._window), self._gen
            try:
                state = self._pass(window)
            except _Closed:
                return
            except Exception as e:  # noqa: BLE001 - the copier must never take the run down
                log.warning("node cache: the copier stopped (%s); reads go to the shared store", e)
                with self._mutex:
                    self.disabled = self.disabled or f"copier error: {e}"
                state = "blocked"
            with self._cond:
                if state in ("idle", "blocked"):
                    self._done_gen = gen
                    self._cond.notify_all()
                if self.closed or self.disabled is not None:
                    self._done_gen = self._gen
                    self._cond.notify_all()
                    return
                if state != "copied" and gen == self._gen:
                    self._cond.wait({"busy": BUSY_POLL_S, "blocked": 1.0}.get(state))

    def _pass(self, window: list[tuple[str, int]]) -> str:
        """Copy the first unit of the window that is neither installed nor being copied elsewhere (a table's
        metadata before its first fragment): 'copied', 'busy' (what is left is being copied elsewhere), 'idle'
        (nothing left) or 'blocked' (no room, or the cache is disabled)."""
        busy = False
        skip: set[str] = set()
        for name, frag in window:
            if name in skip:
                continue
            lay = self.layout(name)
            for unit in (None, frag):
                if self._installed(lay, unit):
                    continue
                state = "failed" if (name, unit) in self._given_up else self._fetch(lay, unit)
                if state == "copied":
                    return "copied"
                if state == "full" or self.disabled is not None:
                    return "blocked"
                if state == "installed":
                    continue
                busy |= state == "busy"
                if unit is None:
                    skip.add(name)                 # no fragment of a table without its metadata
                break
        return "busy" if busy else "idle"

    def _fetch(self, lay: _Layout, frag: int | None) -> str:
        """Claim, copy and install one unit: 'copied', 'installed' (by another process), 'busy' (another process
        copies it), 'full' (no room), or 'failed'."""
        if lay.files is None:
            try:
                fs, root = store_fs(lay.uri)
                root = root.rstrip("/")
                lay.files = {p[len(root) + 1:]: int(info.get("size") or 0)
                             for p, info in fs.find(root, detail=True).items()}
            except Exception as e:  # noqa: BLE001 - the store is read directly instead
                return self._store_failed(lay, frag, e)
        files = lay.unit_files(frag)
        if frag is None and not any(p.startswith("_versions/") for p in files):
            return self._store_failed(lay, frag, FileNotFoundError(f"no manifest of version {lay.version} listed"))
        key = f"{lay.folder[:-len('.lance')]}.{'meta' if frag is None else lay.stems[frag][0]}"
        tmp = self.tmp / f"{key}.part"
        need = sum(files.values())
        if need > self.limit:
            self._given_up.add((lay.name, frag))
            self._count("not_fitting")
            return "failed"
        try:
            with self._locked():
                if self._installed(lay, frag, fresh=True):
                    return "installed"
                if key in self._inflight:
                    return "busy"
                if tmp.exists():
                    fd = _try_lock(tmp)
                    if fd is None:
                        self._count("met_copying_elsewhere")
                        return "busy"
                    shutil.rmtree(tmp)                    # a killed copier's
                    os.close(fd)
                    self._count("stale_temps_removed")
                if not self._make_room(need, lay):
                    self._count("not_fitting")
                    return "full"
                tmp.mkdir()
                fd = _try_lock(tmp)
                if fd is None:                            # cannot happen under the lock; be safe
                    return "busy"
                with self._cond:
                    self._inflight.add(key)
                try:
                    (tmp / "data").mkdir() if frag is None else None
                    for rel, size in files.items():
                        dst = tmp / self._temp_rel(rel, frag)
                        dst.parent.mkdir(parents=True, exist_ok=True)
                        _preallocate(dst, size)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    os.close(fd)
                    self._release(key)
                    raise
        except (OSError, TimeoutError) as e:
            self._fail(e, "cannot be written")
            return "failed"
        t0 = time.perf_counter()
        try:
            self._copy(lay, files, tmp, frag)
            with self._locked():
                self._install(lay, frag, tmp)
        except _StoreError as e:
            self._discard(tmp, fd, key)
            return self._store_failed(lay, frag, e.__cause__ or e)
        except _Closed:
            self._discard(tmp, fd, key)
            raise
        except (OSError, TimeoutError) as e:
            self._discard(tmp, fd, key)
            self._fail(e, "cannot be written")
            return "failed"
        os.close(fd)
        with self._mutex:
            self.counts["units_copied"] += 1
            self.counts["copy_s"] += time.perf_counter() - t0
            self.copied.append(key)
        self._release(key)
        return "copied"

    def _release(self, key: str) -> None:
        with self._cond:
            self._inflight.discard(key)
            self._cond.notify_all()

    @staticmethod
    def _temp_rel(rel: str, frag: int | None) -> str:
        return rel if frag is None else rel[len("data/"):]

    def _copy(self, lay: _Layout, files: dict[str, int], tmp: Path, frag: int | None) -> None:
        fs, root = store_fs(lay.uri)
        root = root.rstrip("/")
        for rel, size in sorted(files.items(), key=lambda kv: kv[0].endswith(".lance")):
            fd = os.open(tmp / self._temp_rel(rel, frag), os.O_WRONLY)
            try:
                try:
                    src = fs.open(f"{root}/{rel}", "rb")
                except Exception as e:  # noqa: BLE001
                    raise _StoreError(str(e)) from e
                with src:
                    off = 0
                    while off < size:
                        ask = min(CHUNK, size - off)
                        if self.stall and frag is not None and off == 0:
                            ask = max(1, size // 2)
                        try:
                            chunk = src.read(ask)
                        except Exception as e:  # noqa: BLE001
                            raise _StoreError(str(e)) from e
                        if not chunk:
                            raise _StoreError(f"{rel}: {off} of {size} bytes read")
                        view = memoryview(chunk)
                        while view:
                            k = os.pwrite(fd, view, off)
                            view, off = view[k:], off + k
                        self._count("bytes_copied", len(chunk))
                        if self.closed:
                            raise _Closed()
                        if self.stall and frag is not None and off < size:
                            time.sleep(self.stall)
                os.fsync(fd)
            finally:
                os.close(fd)

    def _install(self, lay: _Layout, frag: int | None, tmp: Path) -> None:
        """Rename a copied unit into place (under the lock): the metadata folder in one rename; a fragment's blob
        folders, then its ``.lance`` files."""
        folder = self.dir / lay.folder
        if frag is None:
            os.rename(tmp, folder)
            return
        data = folder / "data"
        for stem in lay.stems[frag]:
            if (tmp / stem).is_dir():
                shutil.rmtree(data / stem, ignore_errors=True)     # an orphan of an interrupted eviction
                os.rename(tmp / stem, data / stem)
        for stem in lay.stems[frag]:
            os.rename(tmp / f"{stem}.lance", data / f"{stem}.lance")
        shutil.rmtree(tmp)

    def _discard(self, tmp: Path, fd: int, key: str) -> None:
        try:
            with self._locked():
                shutil.rmtree(tmp, ignore_errors=True)
        except (OSError, TimeoutError):
            pass                                  # left for the next copier, as a killed copier's would be
        os.close(fd)
        self._release(key)

    def _store_failed(self, lay: _Layout, frag: int | None, err: Exception) -> str:
        with self._mutex:
            self.counts["copy_errors"] += 1
            first = self.counts["copy_errors"] == 1
        self._given_up.add((lay.name, frag))
        (log.warning if first else log.debug)("node cache: copying %s from the store failed (%s); its rows are "
                                              "read from the store", lay.name, err)
        return "failed"

    def _count(self, key: str, n: int = 1) -> None:
        with self._mutex:
            self.counts[key] += n

    # ---- the bound -------------------------------------------------------------------------------
    def _make_room(self, need: int, lay: _Layout) -> bool:
        """Whether ``need`` more bytes fit under the limit, after removing (under the lock) orphaned temporary
        copies, then the least recently wanted fragments this process does not want, then empty metadata."""
        used = _size(self.dir)
        if used + need <= self.limit:
            return True
        with self._cond:
            window = list(self._window)
        keep_frags = set()
        keep_tables = {lay.folder}
        for name, frag in window:
            wl = self.layout(name)
            keep_tables.add(wl.folder)
            keep_frags.update((wl.folder, s) for s in wl.stems[frag])
        stale, frags, metas = [], [], []
        for t in self.tmp.iterdir():
            fd = _try_lock(t)
            if fd is not None:
                os.close(fd)                      # nobody holds it: a killed copier's (we hold the cache lock)
                stale.append((0.0, [t]))
        claims = [t.name for t in self.tmp.iterdir()]
        for folder in self.dir.glob("*.lance"):
            data = folder / "data"
            markers = list(data.glob("*.lance")) if data.is_dir() else []
            for m in markers:
                if (folder.name, m.stem) not in keep_frags:
                    frags.append((m.stat().st_mtime, [m, data / m.stem]))
            for d in data.iterdir() if data.is_dir() else []:
                if d.is_dir() and not (data / f"{d.name}.lance").exists():
                    stale.append((0.0, [d]))      # blob folder of a fragment whose eviction was interrupted
            prefix = folder.name[:-len(".lance")] + "."
            if not markers and folder.name not in keep_tables and not any(c.startswith(prefix) for c in claims):
                metas.append((folder.stat().st_mtime, [folder]))
        victims = [("stale_temps_removed", paths) for _, paths in stale]
        victims += [("evicted_units", paths) for _, paths in sorted(frags, key=lambda e: e[0])]
        victims += [("evicted_units", paths) for _, paths in sorted(metas, key=lambda e: e[0])]
        for counter, paths in victims:
            freed = 0
            for p in paths:                       # the .lance file first: readers see the fragment as gone
                self._known.discard(str(p))
                if p.exists():
                    freed += _size(p)
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            used -= freed
            self._count(counter)
            if counter == "evicted_units":
                self._count("evicted_bytes", freed)
            if used + need <= self.limit:
                return True
        return False


class Lookahead:
    """The fragments a loader will read in its next ``steps`` steps, planned in a thread of its own and sent to the
    cache as its window. ``planner`` is the loader's planning on streams of its own; the loader posts the next
    step it will plan and its stream positions then, and never waits. Plans already made are kept while the
    posted positions follow them; other positions (a resume) start the lookahead over."""

    def __init__(self, cache: NodeCache, steps: int, planner, fragments_of):
        self.cache, self.steps, self.planner, self.fragments_of = cache, steps, planner, fragments_of
        self._ahead: deque[tuple[int, dict, list]] = deque()    # (step, positions before it, fragments it reads)
        self._pos: dict = {}                                     # positions after the last planned step
        self._posted: tuple[int, dict] | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="difftrain-lookahead", daemon=True)
        self._thread.start()

    def post(self, step: int, positions: dict) -> None:
        with self._cond:
            if self._posted is None:
                with self.cache._cond:
                    self.cache._pending += 1
            self._posted = (step, positions)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._posted is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                (step, positions), self._posted = self._posted, None
            try:
                self._advance(step, positions)
            except Exception as e:  # noqa: BLE001 - the lookahead must never take the run down
                log.warning("node cache: the lookahead stopped (%s); reads go on without it", e)
                return
            finally:
                with self.cache._cond:
                    self.cache._pending -= 1
                    self.cache._cond.notify_all()

    def _positions(self) -> dict:
        return {s.name: [s.epoch, s.pos] for streams in self.planner.streams.values() for s in streams}

    def _advance(self, step: int, positions: dict) -> None:
        ahead = self._ahead
        while ahead and ahead[0][0] < step:
            ahead.popleft()
        if not ahead or ahead[0][0] != step or ahead[0][1] != positions:
            ahead.clear()
            self._pos = positions
        start = ahead[-1][0] + 1 if ahead else step
        for streams in self.planner.streams.values():
            for s in streams:
                s.epoch, s.pos = self._pos[s.name]
        for k in range(start, step + self.steps):
            before = self._positions()
            ahead.append((k, before, self.fragments_of(self.planner._plan(k))))
        self._pos = self._positions()
        self.cache.want([u for _, _, units in ahead for u in units])
