"""The node-local cache in front of the shared latent store: Lance fragments copied ahead of the plan.

**What is cached, and the unit.** The unit is one Lance fragment: its ``.lance`` data file and, for latents
over 64 KiB, its blob sidecar folder. The local copy of a table at version v holds what Lance reads to open
that version (its manifest, deletion and index files; installed first) and the fragments installed so far
(``cache_folder.py`` has the layout). Lance opens a fragment's files only when a row of it is read (checked
with pylance 14), so a dataset opened on the local copy serves the rows of the installed fragments; the loader
splits each read by fragment (``split``), reads the others from the shared store and merges by sample id.

**Filled ahead of the plan.** The loader's plan is a pure function of its stream positions, so the fragments of
the next ``data.cache_lookahead`` steps are known: a ``Lookahead`` thread plans them on a copy of the streams
and gives them to the cache as its window (``want``), first needed first; ``COPY_THREADS`` copiers per process
fetch the window in that order, through fsspec (``store_fs``).

**One copy per node, atomic install, no orphans, the bound.** The processes sharing the folder claim units
under a cache-wide lock, copy into flocked, preallocated temporary copies and install them by rename; a unit
another process copies is read from the store until installed; a temporary copy nobody holds (a copier killed
mid-copy) is removed by the next copier of that unit or by one making room. ``data.cache_gb`` bounds every file
in the folder, copies in progress included; room is made by evicting the least recently wanted fragments this
process does not want. Readers only open installed files.

**Fallback.** A cache folder that cannot be created or written, a full disk or a lock held too long: one warning,
counted (``cache_errors``, ``disabled``), no more copies, reads from the shared store. A local read that fails (a
fragment evicted meanwhile) is read again from the store. Never a crash, never a hang.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from difftrain.data.store.cache_folder import CacheFolder, Claim, Layout, is_full_disk

log = logging.getLogger("difftrain")

CHUNK = 8 << 20                        # bytes a store read call asks for
COPY_THREADS = 4                       # copies in flight per process: a network store's latency is hidden
BUSY_POLL_S = 0.05                     # how often a unit another process copies is looked at again
STALL_ENV = "DIFFTRAIN_CACHE_STALL_S"  # test hook: every fragment copy pauses this long halfway
CLOSE_TIMEOUT_S = 10.0                 # close() waits this long for the copiers (daemon threads) to stop


def store_fs(uri: str):
    """The fsspec filesystem and root path of a store table. The cache copies through it (bench/loader.py wraps it
    to model a slow network store)."""
    import fsspec
    return fsspec.core.url_to_fs(uri)


class _StoreError(Exception):
    """Reading the shared store failed: not the cache's fault; the unit is given up, the cache goes on."""


class _Closed(Exception):
    pass


class NodeCache:
    """Copies the fragments a loader will read into a node-local folder shared by the node's processes."""

    def __init__(self, directory: str, limit_bytes: float, tables: dict[str, tuple[str, object]]):
        self.dir, self.limit = Path(directory), float(limit_bytes)
        self._tables = tables                          # name -> (store uri, the store dataset at its version)
        self._layouts: dict[str, Layout] = {}
        self._local: dict[str, object] = {}            # name -> Lance dataset opened on the local copy
        self._mutex = threading.Lock()                 # layouts, local datasets, counters
        lock = threading.Lock()
        self._cond = threading.Condition(lock)         # the window or the copiers' state changed
        self._work = threading.Condition(lock)         # copiers wait here, woken one at a time
        self._window: list[tuple[str, int]] = []
        self._gen = 0                                  # bumped on every change of the window
        self._done_gen = -1                            # the window the copiers last found nothing left to do in
        self._pending = 0                              # lookahead requests not yet turned into a window
        self._inflight: set[str] = set()               # units this process's copiers hold
        self._given_up: set[tuple[str, int | None]] = set()
        self.closed = False
        self.disabled: str | None = None
        self.stall = float(os.environ.get(STALL_ENV, "0") or 0)
        self.copied: list[str] = []                    # units this process copied (tests count copies)
        self.counts = {"units_copied": 0, "bytes_copied": 0, "copy_s": 0.0, "stale_temps_removed": 0,
                       "evicted_units": 0, "evicted_bytes": 0, "not_fitting": 0, "met_copying_elsewhere": 0,
                       "copy_errors": 0, "cache_errors": 0, "local_read_failures": 0}
        self.folder: CacheFolder | None = None
        try:
            self.folder = CacheFolder(self.dir, self.limit, self._count)
        except OSError as e:
            self._fail(e, "cannot be created or written")
        self._threads = [threading.Thread(target=self._run, name=f"difftrain-cache-{i}", daemon=True)
                         for i in range(COPY_THREADS if self.folder is not None else 0)]
        for t in self._threads:
            t.start()

    # ---- the loader's side -----------------------------------------------------------------------
    def layout(self, name: str) -> Layout:
        with self._mutex:
            lay = self._layouts.get(name)
            if lay is None:
                uri, ds = self._tables[name]
                frags = ds.get_fragments()
                counts = [f.count_rows() for f in frags]     # as the loader's index counts rows
                bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
                stems = [[Path(df.path).stem for df in f.metadata.files] for f in frags]
                lay = self._layouts[name] = Layout(name, uri, ds.version, bounds, stems)
        return lay

    def fragments(self, name: str, rows: np.ndarray) -> list[int]:
        """The fragments holding ``rows`` (dataset row numbers), in the order the rows first meet them."""
        frag = np.searchsorted(self.layout(name).bounds, rows, side="right") - 1
        _, first = np.unique(frag, return_index=True)
        return frag[np.sort(first)].tolist()

    def want(self, units: list[tuple[str, int]]) -> None:
        """The fragments (table, fragment index) this process reads next, first needed first: the copiers fetch
        them in this order, and this process does not evict them. A fragment entering the window is stamped as
        wanted now, for every process's least-recently-wanted eviction."""
        seen: set[tuple[str, int]] = set()
        window = [u for u in units if not (u in seen or seen.add(u))]
        with self._cond:
            if window == self._window or self.folder is None:
                return
            new = set(window) - set(self._window)
            idle = self._done_gen == self._gen
            self._window, self._gen = window, self._gen + 1
            if idle and all(self.folder.installed(self.layout(n), f) for n, f in new):
                self._done_gen = self._gen              # nothing to copy: the copiers sleep on
            else:
                self._work.notify()                     # one copier; it wakes another when it finds work
        for name, frag in new:
            self.folder.stamp(self.layout(name), frag)

    def split(self, name: str, rows: np.ndarray):
        """(a Lance dataset on the local copy, or None; a mask of the ``rows`` whose fragment is installed)."""
        none = None, np.zeros(len(rows), dtype=bool)
        if self.folder is None:
            return none
        lay = self.layout(name)
        frag = np.searchsorted(lay.bounds, rows, side="right") - 1
        local = [f for f in np.unique(frag).tolist() if self.folder.installed(lay, f, fresh=True)]
        ds = self._local_ds(lay) if local else None
        return (ds, np.isin(frag, local)) if ds is not None else none

    def read_failed(self, name: str, err: Exception) -> None:
        """A read of the local copy failed (a fragment evicted meanwhile by another process): read from the store."""
        self._count("local_read_failures")
        log.debug("node cache: a local read of %s failed (%s); read from the store", name, err)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until the copiers have nothing left to do for the current window; True if all of it is installed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while ((self._pending or self._done_gen != self._gen or self._inflight) and self.disabled is None
                   and not self.closed):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            window = list(self._window)
        return self.folder is not None and all(self.folder.installed(self.layout(n), f, fresh=True) for n, f in window)

    def stats(self) -> dict:
        with self._mutex:
            out = dict(self.counts)
        out["disabled"] = self.disabled
        return out

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
            self._work.notify_all()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S       # a copier stuck on a store read is left behind
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.folder is not None and not any(t.is_alive() for t in self._threads):
            self.folder.close()

    def _local_ds(self, lay: Layout):
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

    def _count(self, key: str, n: float = 1) -> None:
        with self._mutex:
            self.counts[key] += n

    def _fail(self, err: BaseException, what: str) -> None:
        """A fault of the cache folder: one warning, counted; no more copies (reads go to the store)."""
        with self._mutex:
            self.counts["cache_errors"] += 1
            first = self.disabled is None
            if first:
                self.disabled = f"{what}: {err}"
        if first:
            hint = ("free the disk or lower data.cache_gb below its free space" if is_full_disk(err) else
                    "data.cache_dir must be a node-local folder this process can create and write")
            log.warning("node cache %s %s (%s); training reads the shared store instead (%s)", self.dir, what, err,
                        hint)

    # ---- the copiers -----------------------------------------------------------------------------
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
            except Exception as e:  # noqa: BLE001 - a copier must never take the run down
                self._fail(e, "copier failed")
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
                    self._work.wait({"busy": BUSY_POLL_S, "blocked": 1.0}.get(state))

    def _pass(self, window: list[tuple[str, int]]) -> str:
        """Copy the first unit of the window that is neither installed nor being copied (a table's metadata before
        its fragments): 'copied', 'busy' (what is left is being copied), 'idle' (nothing left) or 'blocked' (no
        room, or the cache is disabled)."""
        busy = False
        skip: set[str] = set()
        for name, frag in window:
            if name in skip:
                continue
            lay = self.layout(name)
            for unit in (None, frag):
                if self.folder.installed(lay, unit):
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

    def _keep(self, lay: Layout) -> tuple[set[str], set[tuple[str, str]]]:
        """The table folders and (folder, stem) fragments of this process's window, and the folder of the table
        ``lay`` a unit is being copied for: not evicted by this process."""
        with self._cond:
            window = list(self._window)
        tables, frags = {lay.folder}, set()
        for name, frag in window:
            lay = self.layout(name)
            tables.add(lay.folder)
            frags.update((lay.folder, s) for s in lay.stems[frag])
        return tables, frags

    def _fetch(self, lay: Layout, frag: int | None) -> str:
        """Claim, copy and install one unit: 'copied', 'installed' (by another process), 'busy' (being copied),
        'full' (no room) or 'failed'."""
        try:
            if lay.files is None:
                fs, root = store_fs(lay.uri)
                root = root.rstrip("/")
                lay.files = {p[len(root) + 1:]: int(info.get("size") or 0)
                             for p, info in fs.find(root, detail=True).items()}
            files = lay.unit_files(frag)
            if frag is None and not any(p.startswith("_versions/") for p in files):
                raise FileNotFoundError(f"no manifest of version {lay.version} listed")
        except Exception as e:  # noqa: BLE001 - the store is read directly instead
            return self._store_failed(lay, frag, e)
        if sum(files.values()) > self.limit:
            self._given_up.add((lay.name, frag))
            self._count("not_fitting")
            return "failed"
        key = lay.key(frag)
        try:
            with self._cond:
                if key in self._inflight:
                    return "busy"                          # another thread of this process copies it
            with self.folder.locked():
                claim = self.folder.claim(lay, frag, files, lambda: self._keep(lay))
                if isinstance(claim, Claim):
                    with self._cond:
                        self._inflight.add(key)
                        self._work.notify()             # another copier may find more to do
        except (OSError, TimeoutError) as e:
            self._fail(e, "cannot be written")
            return "failed"
        if claim == "busy":
            self._count("met_copying_elsewhere")
        if claim == "full":
            self._count("not_fitting")
        if not isinstance(claim, Claim):
            return claim
        t0 = time.perf_counter()
        try:
            self._copy(lay, files, claim, frag)
            with self.folder.locked():
                self.folder.install(lay, frag, claim)
        except (_StoreError, _Closed, OSError, TimeoutError) as e:
            self.folder.discard(claim)
            self._release(key)
            if isinstance(e, _Closed):
                raise
            if isinstance(e, _StoreError):
                return self._store_failed(lay, frag, e.__cause__ or e)
            self._fail(e, "cannot be written")
            return "failed"
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

    def _copy(self, lay: Layout, files: dict[str, int], claim: Claim, frag: int | None) -> None:
        """Read the unit's files from the store into the claim's preallocated files, then fsync them."""
        fs, root = store_fs(lay.uri)
        root = root.rstrip("/")
        for rel, size in files.items():
            fd = os.open(claim.tmp / CacheFolder.temp_path(rel, frag), os.O_WRONLY)
            try:
                try:
                    src = fs.open(f"{root}/{rel}", "rb")
                except Exception as e:  # noqa: BLE001
                    raise _StoreError(str(e)) from e
                with src:
                    off = 0
                    while off < size:
                        stall = self.stall and frag is not None
                        try:
                            chunk = src.read(max(1, size // 2) if stall and off == 0 else min(CHUNK, size - off))
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
                        if stall and off < size:
                            time.sleep(self.stall)
                os.fsync(fd)
            finally:
                os.close(fd)

    def _store_failed(self, lay: Layout, frag: int | None, err: Exception) -> str:
        with self._mutex:
            self.counts["copy_errors"] += 1
            first = self.counts["copy_errors"] == 1
        self._given_up.add((lay.name, frag))
        (log.warning if first else log.debug)("node cache: copying %s from the store failed (%s); its rows are "
                                              "read from the store", lay.name, err)
        return "failed"


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
            if self._closed:
                return
            if self._posted is None:
                with self.cache._cond:
                    self.cache._pending += 1
            self._posted = (step, positions)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=CLOSE_TIMEOUT_S)

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
                with self._cond:
                    self._closed = True
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
