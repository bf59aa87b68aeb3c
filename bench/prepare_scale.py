"""``difftrain prepare`` at scale: the driver's memory over 10^4..10^6 rows, encoder actors, near-duplicate recall.
Prints one JSON object.

Synthetic data, written once under ``--dir`` and reused: 32x32 PNGs (an 8x8 grid of random colours, smoothed) in
uncompressed tar shards of 10^4, one in 100 an exact copy of the one before, one in 50 a near copy (the one before
two grey levels brighter, or with a brighter top row), one in 20 scored below the score filter; a Parquet manifest
per size (image = ``shards/NAME.tar#MEMBER``, caption, quality). Every run curates with size, caption, exact_dup,
score and near_dup (4 bits) filters.

- ``--dry-rows`` (default 10^4 and 10^6): ``prepare --dry-run`` (curation only); ``driver_rss_growth_mb`` is the
  peak RSS of this process (the Ray driver; workers are other processes) during the largest run minus during
  the smallest (target <= 50).
- ``--sizes`` x ``--actors`` (default 10^4, 10^5 x 1, 2): a full prepare into a fresh store, one stage of one
  32x32 bucket, a small diffusers AutoencoderKL (random weights, x2) so that encoding, not decoding, limits the
  rate: ``rows_per_s`` (encoded rows a second of the encode phase) and ``encoder_rows`` (rows per actor, with
  ``fair_share_min``: the least an actor did over its fair share).
- Near duplicates: the Ray job's drops against the rule over all pairs (``near_dup.near_dup_keepers`` with a
  window as large as any bucket, which test_prepare_scale.py checks against brute force), on the shapes export
  (``difftrain shapes export`` defaults, the shapes-store preset's filters + near_dup 4 bits: ``near_dup_recall``,
  ``near_dup_comparisons_per_row``) and on the ``--recall-rows`` manifests (default: the largest dry run's).

    python bench/prepare_scale.py [--dir DIR] [--sizes 10000 100000] [--dry-rows 10000 1000000] [--actors 1 2]
                                  [--recall-rows N ...] [--cpus N]

Ray starts with ``--cpus`` logical CPUs (default max(3, cores)): two CPU encoder actors need a third for decoding.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import threading
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np

SHARD = 10_000
WORDS = ("red", "green", "blue", "yellow", "grey", "bright", "dark", "soft", "square", "round", "pattern", "field")
FILTERS = [{"kind": "size", "min_side": 16}, {"kind": "caption", "min_words": 2}, {"kind": "exact_dup"},
           {"kind": "score", "column": "quality", "min": 0.5}, {"kind": "near_dup", "distance": 4}]
NEAR = FILTERS[-1]                  # last: the rows it sees are those kept or dropped by it


# --------------------------------------------------------------------------- synthetic data

def _png(i: int) -> bytes:
    from PIL import Image

    if i % 100 == 99:
        return _png(i - 1)                                       # an exact copy of the one before
    rng = np.random.default_rng(i - 1 if i % 50 == 48 else i)
    img = np.asarray(Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize(
        (32, 32), Image.Resampling.BILINEAR)).astype(np.int16)
    if i % 50 == 48:                                             # a near copy of the one before: brighter, or
        img = img + 2 if i % 100 == 48 else np.where(np.arange(32)[:, None, None] == 0, img + 20, img)  # a top row
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _write_shard(args: tuple[Path, int]) -> None:
    path, k = args
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for i in range(k * SHARD, (k + 1) * SHARD):
            data = _png(i)
            info = tarfile.TarInfo(f"{i:07d}.png")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tmp.rename(path)


def synthetic_manifest(root: Path, n: int) -> Path:
    """The manifest of the first ``n`` synthetic images (shards written as needed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = root / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    todo = [(shards / f"shard-{k:04d}.tar", k) for k in range((n + SHARD - 1) // SHARD)]
    todo = [t for t in todo if not t[0].exists()]
    if todo:
        with Pool(min(len(todo), os.cpu_count() or 1)) as pool:
            pool.map(_write_shard, todo)
    path = root / f"manifest-{n}.parquet"
    if not path.exists():
        rng = np.random.default_rng(0)
        words = rng.integers(0, len(WORDS), (n, 3))
        pq.write_table(pa.table({
            "id": [f"img{i:07d}" for i in range(n)],
            "image": [f"shards/shard-{i // SHARD:04d}.tar#{i:07d}.png" for i in range(n)],
            "caption": [f"a {WORDS[a]} {WORDS[b]} {WORDS[c]}" for a, b, c in words.tolist()],
            "quality": [0.2 if i % 20 == 3 else 0.9 for i in range(n)]}), path)      # never a copy or its original
    return path


# --------------------------------------------------------------------------- the runs

class PeakRSS:
    """The peak resident memory of this process while the block runs (sampled every 50 ms)."""

    def __enter__(self):
        self.peak, self._stop = _rss_mb(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def small_vae(root: Path) -> str:
    path = root / "vae"
    if not (path / "config.json").exists():
        import diffusers
        import torch

        torch.manual_seed(0)
        diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64),
                                layers_per_block=1, latent_channels=4, norm_num_groups=32).save_pretrained(path)
    return str(path)


def synthetic_cfg(manifest: Path, store: Path, *extra: str):
    from difftrain.config import load_config

    cfg = load_config(None, [f"data.store={store}", "data.max_error_rate=0.05", *extra,
                             'data.stages=[{name = "s", start_step = 0, buckets = [[32, 32]], global_batch = 8}]'])
    cfg.data.sources = [{"name": "synthetic", "kind": "manifest", "path": str(manifest)}]
    cfg.data.filters = [dict(f) for f in FILTERS]
    return cfg


def dry_run(root: Path, n: int) -> dict:
    from difftrain.data.prepare.job import prepare

    cfg = synthetic_cfg(synthetic_manifest(root, n), root / "stores" / "dry")
    with PeakRSS() as rss:
        s = prepare(cfg, dry_run=True, progress=False)
    return {"rows": s["inputs"], "seconds": s["seconds"], "rows_per_s": round(s["inputs"] / s["seconds"], 1),
            "driver_rss_peak_mb": round(rss.peak, 1), "kept": s["kept"], "reasons": s["reasons"],
            "near_dup": s.get("near_dup")}


def encode_run(root: Path, n: int, actors: int, vae: str) -> dict:
    from difftrain.data.prepare.job import prepare

    store = root / "stores" / f"enc-{n}-{actors}"
    shutil.rmtree(store, ignore_errors=True)
    cfg = synthetic_cfg(synthetic_manifest(root, n), store, f"data.encoder_actors={actors}",
                        "autoencoder.kind=diffusers", f"autoencoder.path={vae}")
    with PeakRSS() as rss:
        s = prepare(cfg, progress=False)
    shutil.rmtree(store, ignore_errors=True)
    rows = s["encoder_rows"]
    return {"rows": s["encoded"], "rows_per_s": s["images_per_s"], "encode_seconds": s["encode_seconds"],
            "seconds": s["seconds"], "driver_rss_peak_mb": round(rss.peak, 1),
            "encoder_actors": s["encoder_actors"], "decode_tasks": s["decode_tasks"],
            "encoder_rows": rows, "fair_share_min": round(min(rows) / (sum(rows) / len(rows)), 3) if rows else None}


def near_dup_recall(cfg, distance: int) -> dict:
    """The Ray job's near-duplicate drops against the rule over all pairs, for the rows that reach the filter."""
    from difftrain.data.prepare.curation_ops import check_sources, curated_dataset
    from difftrain.data.prepare.near_dup import near_dup_keepers

    ds, stats = curated_dataset(cfg, check_sources(cfg))
    ids, hashes, dropped = [], [], set()
    for b in ds.select_columns(["sample_id", "phash", "reason"]).iter_batches(batch_size=None, batch_format="pyarrow"):
        for sid, ph, reason in zip(b["sample_id"].to_pylist(), b["phash"].to_pylist(), b["reason"].to_pylist()):
            if not reason or reason.startswith("near_dup: "):
                ids.append(sid)
                hashes.append(ph)
                if reason:
                    dropped.add(sid)
    exact, _ = near_dup_keepers(ids, hashes, distance, window=len(ids))
    should = {s for s, k in zip(ids, exact.tolist()) if k >= 0}
    return {"rows": len(ids), "dropped_all_pairs": len(should), "dropped": len(dropped),
            "recall": round(len(dropped & should) / max(1, len(should)), 4),
            "same_outcome": round(1 - len(dropped ^ should) / max(1, len(ids)), 4),
            "comparisons_per_row": stats["near_dup"]["comparisons_per_row"], "window": stats["near_dup"]["window"],
            "distinct_hashes": stats["near_dup"]["hashes"]}


def shapes_near_dup(root: Path) -> dict:
    from difftrain.config import load_config, preset_path
    from difftrain.shapes.export import export_shapes

    export = root / "shapes-export"
    if not (export / "export.json").exists():
        export_shapes(export)
    cfg = load_config(preset_path("shapes-store"))
    for spec in cfg.data.sources:
        spec["path"] = str(export / spec["path"].removeprefix("shapes-export/"))
    cfg.data.filters = list(cfg.data.filters) + [dict(NEAR)]
    return near_dup_recall(cfg, NEAR["distance"])


def _progress(what: str, result: dict) -> dict:
    print(json.dumps({what: result}), file=sys.stderr, flush=True)        # each run as it ends, on stderr
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/difftrain-prepare-scale", help="data and stores (the data is reused)")
    ap.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000], help="rows of the encode runs")
    ap.add_argument("--dry-rows", type=int, nargs="*", default=[10_000, 1_000_000], help="rows of the dry runs")
    ap.add_argument("--actors", type=int, nargs="*", default=[1, 2], help="encoder actors of the encode runs")
    ap.add_argument("--recall-rows", type=int, nargs="*", default=None,
                    help="synthetic rows whose near-duplicate recall is measured (default: the most --dry-rows)")
    ap.add_argument("--cpus", type=int, default=max(3, os.cpu_count() or 1), help="logical CPUs of the local Ray")
    args = ap.parse_args()
    if args.recall_rows is None:
        args.recall_rows = [max(args.dry_rows)] if args.dry_rows else []
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for n in sorted(set(args.sizes) | set(args.dry_rows) | set(args.recall_rows)):   # the data: not in any figure
        synthetic_manifest(root, n)
    from difftrain.data.prepare.job import start_ray
    start_ray(num_cpus=args.cpus)
    out: dict = {"cores": os.cpu_count(), "ray_cpus": args.cpus}
    dry = {str(n): _progress(f"dry {n}", dry_run(root, n)) for n in sorted(args.dry_rows)}
    out["dry_run"] = dry
    if len(dry) > 1:       # the driver is this process; a Ray worker's memory is its own
        lo, hi = dry[str(min(args.dry_rows))], dry[str(max(args.dry_rows))]
        out["driver_rss_growth_mb"] = round(hi["driver_rss_peak_mb"] - lo["driver_rss_peak_mb"], 1)
    vae = small_vae(root)
    enc = {str(n): {str(a): _progress(f"encode {n} x{a}", encode_run(root, n, a, vae)) for a in args.actors}
           for n in sorted(args.sizes)}
    out["encode"] = enc
    out["rows_per_s"] = {n: {a: r["rows_per_s"] for a, r in v.items()} for n, v in enc.items()}
    shapes = _progress("near_dup shapes export", shapes_near_dup(root))
    out["near_dup_recall"] = shapes["recall"]
    out["near_dup_comparisons_per_row"] = shapes["comparisons_per_row"]
    out["near_dup"] = {"shapes_export": shapes}
    for n in args.recall_rows:
        out["near_dup"][f"synthetic_{n}"] = _progress(f"near_dup {n}", near_dup_recall(
            synthetic_cfg(synthetic_manifest(root, n), root / "stores" / "dry"), NEAR["distance"]))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
