"""The node-local cache shared by the ranks of a node, with real processes: each fragment is copied once, read
from the cache once installed, the folder never exceeds data.cache_gb, a copier killed mid-copy leaves nothing
anyone reads and its temporary copy is removed by the next copier; a cache folder that cannot be created, is
read-only or sits on a full disk makes the reads fall back to the store with one warning."""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from difftrain.config.load import from_dict
from difftrain.config.stages import parse_stages
from difftrain.data.store import tables as st
from difftrain.data.batch import frames_of
from difftrain.data.store.loader import StoreLoader

FACTOR = 4
SIDE = 128                 # 48 x 32 x 32 bf16 = 96 KiB a latent: Lance keeps it in a blob sidecar file
FRAGMENTS, ROWS = 16, 8    # 128 samples in 16 fragments
WORLD = 4                  # the ranks of one node
TABLE = f"s/{SIDE}x{SIDE}/t2i"


def make_cfg(store: str, **data):
    return from_dict({"run": {"seed": 5}, "autoencoder": {"kind": "pixel-unshuffle", "factor": FACTOR},
                      "data": {"source": "store", "store": store, "prefetch": 2, "caption_dropout": 0.0,
                               "stages": [{"name": "s", "start_step": 0, "buckets": [[SIDE, SIDE]],
                                           "global_batch": 16}], **data},
                      "train": {"global_batch": 16}})


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One table of FRAGMENTS fragments; a sample's latent values are a function of its id."""
    store = str(tmp_path_factory.mktemp("nc") / "store")
    cfg = make_cfg(store)
    stage = parse_stages(cfg)[0]
    b = stage.buckets[0]
    shape = [1, 3 * FACTOR * FACTOR, SIDE // FACTOR, SIDE // FACTOR]
    info = st.TableInfo(TABLE, "s", b.name, "t2i", 1, shape, st.cache_key(cfg, stage, b, "t2i"), False)
    for f in range(FRAGMENTS):
        ids = list(range(f * ROWS + 1, (f + 1) * ROWS + 1))
        st.write_table(store, info, {"sample_id": ids, "caption": ["a red circle"] * ROWS,
                                     "latents": [np.full(shape, value(i), np.float32) for i in ids]})
    return store


def value(sample_id: int) -> float:
    return (sample_id % 97) / 97.0


def tokenize(prompts):
    return {"ids": torch.ones(len(prompts), 2, dtype=torch.long)}


def checked_ids(batches) -> list[int]:
    """The sample ids of a step, after checking every latent holds its sample's value."""
    out = []
    for b in batches:
        lat = frames_of(b.x0_BLC, b.grid)
        for j, sid in enumerate(b.sample_ids):
            assert torch.all(lat[j] == torch.tensor(value(sid)).to(torch.bfloat16).float()), f"sample {sid}"
            out.append(sid)
    return out


def drain(loader) -> None:
    for _, f in loader.queue:              # the steps already submitted are read
        f.result()


def reference(store: str, steps: int) -> list[list[int]]:
    out = [[] for _ in range(steps)]
    for r in range(WORLD):
        ld = StoreLoader(make_cfg(store), tokenize, r, WORLD)
        for s in range(steps):
            out[s] += checked_ids(next(ld))
        ld.close()
    return out


def _rank(rank: int, store: str, cache: str, gb: float, lookahead: int, cold: int, warm: int, barrier, out) -> None:
    """One rank of the node: ``cold`` steps, then (after every rank got there and its lookahead is installed)
    ``warm`` steps; reports its ids, its read counters before and after the warm steps, and what it copied.
    Each fragment copy pauses 250 ms halfway, so that ranks meet each other's copies in progress (50 ms was not
    always enough on two loaded cores: the four spawned ranks' start-up spread can exceed it)."""
    os.environ["DIFFTRAIN_CACHE_STALL_S"] = "0.25"
    barrier.wait(120)                        # start together, as the ranks of a job do
    loader = StoreLoader(make_cfg(store, cache_dir=cache, cache_gb=gb, cache_lookahead=lookahead), tokenize,
                         rank, WORLD)
    ids = [checked_ids(next(loader)) for _ in range(cold)]
    drain(loader)
    barrier.wait(120)
    before = loader.cache_stats()
    idle = loader.cache.wait_idle(120)
    ids += [checked_ids(next(loader)) for _ in range(warm)]
    drain(loader)
    after = loader.cache_stats()
    out.put({"rank": rank, "ids": ids, "before": before, "after": after, "idle": idle,
             "copied": loader.cache.copied})
    loader.close()


def _stalled_copier(store: str, cache: str) -> None:
    """Rank 0 whose fragment copies stop halfway: it is killed there."""
    os.environ["DIFFTRAIN_CACHE_STALL_S"] = "300"
    loader = StoreLoader(make_cfg(store, cache_dir=cache, cache_gb=1.0, cache_lookahead=4), tokenize, 0, WORLD)
    next(loader)
    threading.Event().wait(300)


def cache_bytes(cache: Path) -> int:
    """Bytes of every file in the cache folder, taken under the cache's own lock (so that a file being renamed
    into place is not counted twice)."""
    fd = os.open(cache / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        total = 0
        for root, _, files in os.walk(cache):
            total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
        return total
    finally:
        os.close(fd)


def run_node(store: str, cache: Path, gb: float, lookahead: int, cold: int, warm: int) -> tuple[list[dict], int]:
    """WORLD processes sharing ``cache``; returns their reports and the largest folder size seen meanwhile."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(WORLD), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store, str(cache), gb, lookahead, cold, warm, barrier, out))
             for r in range(WORLD)]
    cache.mkdir(parents=True, exist_ok=True)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], cache_bytes(cache))
            stop.wait(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for p in procs:
            p.start()
        reports = [out.get(timeout=180) for _ in procs]
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        stop.set()
        sampler.join()
        for p in procs:
            if p.is_alive():
                p.kill()
    return sorted(reports, key=lambda r: r["rank"]), peak[0]


def merged(reports: list[dict]) -> list[list[int]]:
    return [[i for r in reports for i in r["ids"][s]] for s in range(len(reports[0]["ids"]))]


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def locked(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def table_files(store: str) -> dict[str, bytes]:
    root = Path(st.table_uri(store, TABLE)) / "data"
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_node_copies_each_fragment_once_reads_it_locally_and_survives_a_killed_copier(store, tmp_path):
    cache = tmp_path / "cache"
    ctx = mp.get_context("spawn")
    # 1. A copier killed halfway through a fragment.
    victim = ctx.Process(target=_stalled_copier, args=(store, str(cache)))
    victim.start()
    try:
        temp = wait_for(lambda: [t for t in (cache / ".tmp").glob("*.part")
                                 if not t.name.endswith(".meta.part") and locked(t)], 120, "a fragment copy")[0]
        stem = temp.name[:-len(".part")].split(".")[-1]
        folder = next(cache.glob("*.lance"))
        assert not (folder / "data" / f"{stem}.lance").exists()
        # while it copies, another reader of that fragment reads it from the store, never from the copy
        ld = StoreLoader(make_cfg(store, cache_dir=str(cache), cache_gb=1.0, cache_lookahead=4), tokenize, 0, WORLD)
        assert [checked_ids(next(ld)) for _ in range(3)] == [s[:4] for s in reference(store, 3)]
        drain(ld)
        assert ld.cache_stats()["rows_local"] < ld.cache_stats()["rows"]
        ld.close()
        early = list(ld.cache.copied)
    finally:
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(30)
    orphans = list((cache / ".tmp").iterdir())             # its copiers' temporary copies (one a copy thread)
    assert temp in orphans and not [t for t in orphans if locked(t)]       # left behind, held by nobody
    # 2. The node's four ranks: the killed copier's temporary copy is removed by the next copier of that unit.
    steps_cold, steps_warm = 4, 8
    reports, peak = run_node(store, cache, 1.0, 12, steps_cold, steps_warm)
    assert merged(reports) == reference(store, steps_cold + steps_warm)
    assert sum(r["after"]["stale_temps_removed"] for r in reports) == len(orphans)
    assert not list((cache / ".tmp").iterdir())
    copied = early + [u for r in reports for u in r["copied"]]
    assert len(copied) == len(set(copied)), "a unit was copied twice"
    assert not [r["after"] for r in reports if r["after"]["disabled"] or r["after"]["cache_errors"]]
    assert sum(r["after"]["met_copying_elsewhere"] for r in reports) > 0, "the ranks never met a copy in progress"
    installed = {str(p.relative_to(folder / "data")): p.read_bytes() for p in (folder / "data").rglob("*")
                 if p.is_file()}
    store_files = table_files(store)
    assert installed.keys() <= store_files.keys() and all(installed[k] == store_files[k] for k in installed)
    # the killed copier had installed the metadata: the others copied the sixteen fragments, each once
    assert sum(1 for k in installed if k.endswith(".lance")) == FRAGMENTS == len(copied)
    assert not [u for u in copied if u.endswith(".meta")]
    for r in reports:                        # once installed, every row of the warm steps is read from the cache
        assert r["idle"]
        rows = r["after"]["rows"] - r["before"]["rows"]
        assert rows > 0 and r["after"]["rows_local"] - r["before"]["rows_local"] == rows
    assert peak <= 1e9


def test_the_folder_never_exceeds_the_limit(store, tmp_path):
    cache = tmp_path / "cache"
    root = Path(st.table_uri(store, TABLE))
    frag = max(p.stat().st_size for p in (root / "data").rglob("*.blob"))
    meta = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and "data" not in p.relative_to(root).parts)
    limit = meta + 5.5 * (frag + 2048)       # five of the sixteen fragments
    reports, peak = run_node(store, cache, limit / 1e9, 2, 6, 6)
    assert merged(reports) == reference(store, 12)
    assert 0 < peak <= limit and cache_bytes(cache) <= limit
    assert sum(r["after"]["evicted_units"] for r in reports) > 0
    assert not [r["after"] for r in reports if r["after"]["disabled"] or r["after"]["cache_errors"]]
    assert sum(r["after"]["rows_local"] for r in reports) > 0


_FALLBACK = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
sys.path.insert(0, {tests!r})
from test_node_cache import make_cfg, tokenize, checked_ids, drain
from difftrain.data.store.loader import StoreLoader
ld = StoreLoader(make_cfg({store!r}, cache_dir=sys.argv[1], cache_gb=1.0, cache_lookahead=4), tokenize, 0, 4)
ids = [checked_ids(next(ld)) for _ in range(6)]
drain(ld)
print(json.dumps({{"ids": ids, "stats": ld.cache_stats()}}))
ld.close()
"""


def fallback(store: str, cache: str, mount: str = "") -> tuple[dict, str]:
    """A rank reading 6 steps with ``cache`` as its cache folder, in a process of its own (in a private mount
    namespace where ``mount`` is given)."""
    code = _FALLBACK.format(tests=str(Path(__file__).parent), store=store)
    cmd = [sys.executable, "-c", code, cache]
    if mount:
        cmd = ["unshare", "-rm", "sh", "-c", f'mkdir -p "$1" && {mount} "$1" && shift && exec "$@"', "sh", cache]
        cmd += [sys.executable, "-c", code, cache]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def can_mount() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True).returncode == 0


@pytest.mark.parametrize("case", ["cannot be created", "read-only", "full disk"])
def test_a_broken_cache_folder_falls_back_to_the_store_with_one_warning(store, tmp_path, case):
    want = [s[:4] for s in reference(store, 6)]
    if case == "cannot be created":
        (tmp_path / "file").write_text("")
        got, err = fallback(store, str(tmp_path / "file" / "cache"))
    else:
        if not can_mount():
            pytest.skip("needs unshare -rm (a private mount namespace) to mount a small or read-only tmpfs")
        mount = "mount -t tmpfs -o ro,size=1m tmpfs" if case == "read-only" else "mount -t tmpfs -o size=200k tmpfs"
        got, err = fallback(store, str(tmp_path / "cache"), mount)
    assert got["ids"] == want
    stats = got["stats"]
    assert stats["disabled"] and stats["cache_errors"] >= 1 and stats["rows"] == (6 + 2) * 4   # + prefetch
    assert err.count("node cache") == 1, err
    if case == "full disk":                  # 200 kB: the metadata and a fragment or so fit, the rest does not
        assert "lower data.cache_gb" in err
