"""What the store loader costs as the store grows: a real ``StoreLoader`` over Lance tables that hold only the
index columns (sample_id, source, txt_len) of 10^5 to 10^8 samples in three sources, global batch 2048.

For each size it reports
- ``loader_init_s``: opening the store and reading its index (Arrow dictionary codes, never Python strings);
- ``index_bytes_per_sample``: bytes the loader's index arrays hold per sample (id, row, text length);
- ``rss_growth_bytes_per_sample``: the process's resident memory after opening over before, per sample;
- ``plan_ms_p50`` / ``plan_ms_max``: planning one step on the training thread (draw a stream, take its ids
  from the epoch's keyed order, the per-slot draws, the stream positions recorded for the state), over
  ``--steps`` consecutive steps; the streams are resumed near their epoch's end, so every size crosses an
  epoch boundary half way;
- ``plan_cpu_ms_max``: the largest step's CPU time on the planning thread; on a shared machine a wall-clock
  maximum far above it is the thread waiting for a core, not planning work;
and ``plan_growth_1e8_over_1e5``, p50 at the largest size over p50 at the smallest.

    python bench/loader_scale.py [--sizes 1e5 1e6 1e7 1e8] [--steps 2000] [--batch 2048] [--root DIR]

Writing the 10^8-row table takes a few minutes and about 1 GB of disk (kept under --root between runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from difftrain.config import from_dict
from difftrain.config.stages import parse_stages
from difftrain.data.store import tables as st

SOURCES = ("laion_aesthetic_part", "licensed_stock_photos", "curated_highres")
TXT_DIM, POOLED_DIM = 8, 4


def cfg_for(store: str, batch: int):
    return from_dict({"autoencoder": {"kind": "pixel-unshuffle", "factor": 8},
                      "data": {"source": "store", "store": store, "caption_dropout": 0.1, "prefetch": 1,
                               "stages": [{"name": "s", "start_step": 0, "buckets": [[256, 256]],
                                           "global_batch": batch}]},
                      "train": {"global_batch": batch}})


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_index_store(store: str, cfg, n: int, chunk: int = 5_000_000) -> None:
    """A store whose one table holds only the index columns of ``n`` samples (ids scrambled, sources mixed)."""
    import lance
    from safetensors.torch import save_file

    if st.read_manifest(store) is not None:
        return
    shutil.rmtree(store, ignore_errors=True)
    stage = parse_stages(cfg)[0]
    b = stage.buckets[0]
    info = st.TableInfo(st.table_name(stage.name, b.name, "t2i"), stage.name, b.name, "t2i", 1,
                        [1, 3 * 64, b.h // 8, b.w // 8], st.cache_key(cfg, stage, b, "t2i"), True)
    schema = pa.schema([("sample_id", pa.int64()), ("source", pa.string()), ("txt_len", pa.int32())])
    rng = np.random.default_rng(0)
    uri = st.table_uri(store, info.name)

    def batches():
        for lo in range(0, n, chunk):
            k = min(chunk, n - lo)
            ids = (np.arange(lo, lo + k, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(1)
            src = pa.DictionaryArray.from_arrays(pa.array(rng.integers(0, len(SOURCES), k).astype(np.int32)),
                                                 pa.array(SOURCES)).cast(pa.string())
            yield pa.record_batch([pa.array(ids.astype(np.int64)), src,
                                   pa.array(rng.integers(4, 512, k).astype(np.int32))], schema=schema)

    lance.write_dataset(pa.RecordBatchReader.from_batches(schema, batches()), uri, schema=schema,
                        max_rows_per_file=10_000_000)
    save_file({"txt": torch.zeros(1, TXT_DIM), "pooled": torch.zeros(POOLED_DIM)},
              f"{store}/empty_text.safetensors")
    st.write_manifest(store, {"format": st.FORMAT, "tables": {info.name: info.to_json()}, "vocabulary": []})


def measure(store: str, n: int, batch: int, steps: int) -> dict:
    from difftrain.data.store.loader import StoreLoader

    cfg = cfg_for(store, batch)
    write_index_store(store, cfg, n)
    gc.collect()
    before = rss_bytes()
    t0 = time.perf_counter()
    loader = StoreLoader(cfg, None, 0, 1, "cpu")
    init_s = time.perf_counter() - t0
    gc.collect()
    grown = rss_bytes() - before
    try:
        index = sum(t.index_bytes for t in loader.tables.values())
        # Resume every stream near the end of its epoch: half the steps' samples before the boundary.
        state = loader.state_dict()
        streams = loader.streams["s"]
        total = sum(len(s) for s in streams)
        for s in streams:
            share = int(batch * steps / 2 * len(s) / total)
            state["positions"][s.name] = [0, max(0, len(s) - share) % len(s)]
        loader.load_state_dict(state)
        epochs0 = {s.name: s.epoch for s in streams}
        times, cpu = [], []
        for step in range(loader.step, loader.step + steps):
            t, c = time.perf_counter(), time.thread_time()
            loader._plan(step)
            loader._positions()
            cpu.append((time.thread_time() - c) * 1e3)
            times.append((time.perf_counter() - t) * 1e3)
        crossed = all(s.epoch > epochs0[s.name] for s in streams)
    finally:
        loader.close()
    return {"rows": n, "loader_init_s": round(init_s, 2), "index_bytes_per_sample": round(index / n, 2),
            "rss_growth_bytes_per_sample": round(grown / n, 2), "plan_ms_p50": round(float(np.median(times)), 3),
            "plan_ms_max": round(float(np.max(times)), 3), "plan_cpu_ms_max": round(float(np.max(cpu)), 3),
            "epoch_boundary_crossed": crossed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["1e5", "1e6", "1e7", "1e8"])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--root", default=None, help="where the index stores are written (default: a temp dir)")
    args = ap.parse_args()
    sizes = [int(float(s)) for s in args.sizes]
    root = Path(args.root or tempfile.mkdtemp(prefix="loader_scale_"))
    out: dict = {"batch": args.batch, "steps": args.steps, "sizes": {}}
    for n in sizes:
        out["sizes"][str(n)] = measure(str(root / f"store_{n}"), n, args.batch, args.steps)
        print(json.dumps({str(n): out["sizes"][str(n)]}), flush=True)
    p50 = [out["sizes"][str(n)]["plan_ms_p50"] for n in sizes]
    out["plan_growth_largest_over_smallest"] = round(p50[-1] / p50[0], 3)
    if sizes[0] == 10**5 and sizes[-1] == 10**8:
        out["plan_growth_1e8_over_1e5"] = out["plan_growth_largest_over_smallest"]
    out["plan_ms_p50_max"] = max(p50)
    out["plan_ms_max"] = max(out["sizes"][str(n)]["plan_ms_max"] for n in sizes)
    out["index_bytes_per_sample_max"] = max(out["sizes"][str(n)]["index_bytes_per_sample"] for n in sizes)
    print(json.dumps(out))
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
