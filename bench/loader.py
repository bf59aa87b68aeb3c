"""The data path's figures, one JSON object.

1. ``read_bandwidth_ratio``: a store of FLUX-sized latents (16 x 128 x 128 bf16 = 512 KiB, a 1024^2
   image) read by the store loader with shuffled reads (samples/s x bytes per sample) over the raw
   sequential read bandwidth of the same store files, same disk, same run. The page cache is dropped
   for those files (``posix_fadvise(DONTNEED)`` after ``fsync``) before each of the two reads: both are
   cold unless the kernel ignores the advice (``page_cache`` says what was done).
2. ``vs_on_the_fly_ratio``: loader samples/s over an on-the-fly pipeline (PNG decode + resize + crop +
   encode with a diffusers ``AutoencoderKL`` in FLUX's configuration, random weights) at 256^2 on the
   same images.
3. ``train``: ``difftrain shapes export`` -> ``prepare`` (``prepare_images_per_s``,
   ``store_bytes_per_sample``) -> training shapes-tiny from the store (``data_wait_fraction``: data wait
   over step time, from the run's metrics).
4. ``slow`` (with ``--slow-store-ms MS``): the shared store as over a network file system, where every
   request pays a round trip. The model: MS per Lance ``take`` call and MS per latent blob read (the
   loader's direct reads of the store), MS per fsspec listing, ``open`` and ``read`` call (the node cache's
   copies, ``CHUNK`` = 8 MiB a read); the store's index is read at start-up without delay. Two training
   processes (data ranks 0 and 1 of 2, one global batch a step, so each reads its half) run one step each
   ``--slow-step-ms`` (the compute, a sleep) and time what they wait for data, over ``--slow-epochs`` epochs of
   a table of ``--slow-n`` samples (384 KiB latents, 32 a fragment); the first step (the loader's first fill)
   is left out. Once without a cache, once with a cold node cache both processes share (``cache_gb`` above
   the table). ``slow_store_data_wait_cache_off`` and ``..._on`` (data wait over step time; target < 0.02
   with the cache; also over the first epoch and after it), ``cache_hit_rate`` (rows read from the cache over
   rows read, both ranks) and ``store_bytes_read_over_bytes_served`` (fragments copied plus latents read
   directly from the store, over latents served; target <= 1.2). ``data_wait_store_without_delay``: the same
   two ranks with no delay and no cache, what the loader costs on this machine anyway.

    python bench/loader.py [--n 1024] [--parts bandwidth,fly,train] [--slow-store-ms MS]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from difftrain.config.load import from_dict
from difftrain.data.store import tables as st
from difftrain.config.stages import parse_stages


def drop_cache(root: Path) -> str:
    """Evict the store files from the page cache: the whole cache where allowed (root), else per file."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "dropped (sync; echo 1 > /proc/sys/vm/drop_caches) before each read"
    except OSError:
        pass
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "evicted per file (fsync + posix_fadvise DONTNEED) before each read"


def raw_read_bandwidth(root: Path) -> tuple[float, int]:
    total, t0 = 0, time.perf_counter()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(8 << 20):
                total += len(chunk)
    return total / (time.perf_counter() - t0), total


def vae_dir(root: Path) -> str:
    """A diffusers AutoencoderKL in FLUX's configuration (16 latent channels, x8), random weights."""
    from diffusers import AutoencoderKL
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        block_out_channels=(128, 256, 512, 512), layers_per_block=2, use_quant_conv=False,
                        use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)
    path = root / "vae"
    vae.save_pretrained(path)
    return str(path)


def cfg_for(store: str, vae: str, side: int, global_batch: int, threads: int, prefetch: int):
    return from_dict({"autoencoder": {"kind": "diffusers", "path": vae},
                      "data": {"source": "store", "store": store, "read_threads": threads, "prefetch": prefetch,
                               "caption_dropout": 0.0, "stages": [{"name": "s", "start_step": 0,
                                                                   "buckets": [[side, side]],
                                                                   "global_batch": global_batch}]},
                      "train": {"global_batch": global_batch}})


def write_store(store: str, cfg, n: int, latents=None) -> st.TableInfo:
    stage = parse_stages(cfg)[0]
    b = stage.buckets[0]
    shape = [1, 16, b.h // 8, b.w // 8]
    info = st.TableInfo(st.table_name(stage.name, b.name, "t2i"), stage.name, b.name, "t2i", 1, shape,
                        st.cache_key(cfg, stage, b, "t2i"), False)
    rng = np.random.default_rng(0)
    chunk = 128
    for lo in range(0, n, chunk):
        k = min(chunk, n - lo)
        lat = latents[lo:lo + k] if latents is not None else [rng.standard_normal(shape, dtype=np.float32) for _ in range(k)]
        st.write_table(store, info, {"sample_id": list(range(lo, lo + k)), "latents": lat,
                                              "caption": [f"a photo number {i}" for i in range(lo, lo + k)]})
    return info



def loader_rate(cfg, steps: int) -> float:
    from difftrain.data.store.loader import StoreLoader
    loader = StoreLoader(cfg, lambda p: {"ids": torch.zeros(len(p), 1, dtype=torch.long)})
    next(loader)                          # open, first fill
    t0, n = time.perf_counter(), 0
    for _ in range(steps):
        n += sum(len(b) for b in next(loader))
    rate = n / (time.perf_counter() - t0)
    loader.close()
    return rate


def bandwidth_part(root: Path, vae: str, n: int, threads: int) -> dict:
    store = str(root / "store1024")
    cfg = cfg_for(store, vae, 1024, 16, threads, 8)
    write_store(store, cfg, n)
    tables = Path(store) / "tables"
    drop_cache(tables)
    bw, total = raw_read_bandwidth(tables)
    how = drop_cache(tables)
    steps = max(4, n // 16 - 2)
    rate = loader_rate(cfg, steps)
    per_sample = 16 * 128 * 128 * 2
    return {"samples": n, "store_bytes": total, "bytes_per_sample_1024": per_sample,
            "raw_read_mb_s": round(bw / 1e6, 1), "loader_samples_per_s_1024": round(rate, 1),
            "loader_mb_s": round(rate * per_sample / 1e6, 1), "read_bandwidth_ratio": round(rate * per_sample / bw, 3),
            "read_threads": threads, "page_cache": how}


def on_the_fly_part(root: Path, vae_path: str, n_images: int, threads: int) -> dict:
    from PIL import Image

    from difftrain.data.prepare.job import resize_cover_crop
    from difftrain.models.autoencoder import DiffusersAE

    rng = np.random.default_rng(1)
    pngs = []
    for i in range(n_images):         # 384 x 320 photographs stand-ins: smooth gradients plus noise
        yy, xx = np.mgrid[0:320, 0:384]
        img = (np.stack([xx * 0.5 + i, yy * 0.7, (xx + yy) * 0.3], -1) % 256 + rng.normal(0, 8, (320, 384, 3)))
        buf = io.BytesIO()
        Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    ae = DiffusersAE.from_path(vae_path).eval()
    torch.set_num_threads(os.cpu_count() or 2)

    def encode(data: bytes) -> torch.Tensor:
        with Image.open(io.BytesIO(data)) as img:
            arr, _ = resize_cover_crop(img, 256, 256, "center", 0)
        x = torch.from_numpy(arr).float().div(127.5).sub(1).permute(2, 0, 1)[None]
        with torch.no_grad():
            return ae.encode(x)[0]

    encode(pngs[0])
    t0 = time.perf_counter()
    latents = [encode(p).numpy()[None] for p in pngs]
    fly = n_images / (time.perf_counter() - t0)
    store = str(root / "store256")
    cfg = cfg_for(store, vae_path, 256, 8, threads, 8)
    reps = max(1, 256 // n_images)
    write_store(store, cfg, n_images * reps, [latents[i % n_images] for i in range(n_images * reps)])
    drop_cache(Path(store) / "tables")
    rate = loader_rate(cfg, max(4, n_images * reps // 8 - 2))
    return {"on_the_fly_images_per_s_256": round(fly, 2), "loader_samples_per_s_256": round(rate, 1),
            "vs_on_the_fly_ratio": round(rate / fly, 1)}


def train_part(root: Path, steps: int) -> dict:
    import subprocess
    import sys

    exp = root / "shapes"
    subprocess.run([sys.executable, "-m", "difftrain.cli", "shapes", "export", str(exp)], check=True,
                   stdout=subprocess.DEVNULL)
    store = root / "shapes-store"
    cfg_path = root / "store.toml"
    from difftrain.config import preset_path
    cfg_path.write_text(preset_path("shapes-store").read_text().replace('"shapes-export/', f'"{exp}/')
                        .replace('store = "shapes-store"', f'store = "{store}"'))
    out = subprocess.run([sys.executable, "-m", "difftrain.cli", "prepare", str(cfg_path), "--no-progress"],
                         check=True, capture_output=True, text=True)
    prep = json.loads(out.stdout.strip().splitlines()[-1])
    store_bytes = sum(f.stat().st_size for f in (store / "tables").rglob("*") if f.is_file())
    run_dir = root / "run"
    subprocess.run([sys.executable, "-m", "difftrain.cli", "train", str(cfg_path), "--run-dir", str(run_dir),
                    "--no-progress", "--set", f"train.steps={steps}", "--set", "train.log_every=1",
                    "--set", "train.checkpoint_every=0"], check=True, capture_output=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "data_s" in r][10:]          # past start-up
    wait = sum(r["data_s"] for r in rows)
    total = sum(r["data_s"] + r["step_s"] for r in rows)
    return {"prepare_images_per_s": prep["images_per_s"], "prepare_inputs": prep["inputs"], "prepare_kept": prep["kept"],
            "prepare_encoded_rows": prep["encoded"], "store_bytes_per_sample": round(store_bytes / max(1, prep["encoded"])),
            "data_wait_fraction": round(wait / total, 4), "train_steps_measured": len(rows)}


class SlowDataset:
    """A store table's Lance dataset whose ``take`` costs MS a call and ``take_blobs`` MS a blob."""

    def __init__(self, ds, delay_s: float):
        self._ds, self._delay = ds, delay_s

    def take(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._ds.take(*args, **kwargs)

    def take_blobs(self, *args, **kwargs):
        blobs = self._ds.take_blobs(*args, **kwargs)
        time.sleep(self._delay * len(blobs))
        return blobs

    def __getattr__(self, name):
        return getattr(self._ds, name)


class SlowFile:
    def __init__(self, f, delay_s: float):
        self._f, self._delay = f, delay_s

    def read(self, n: int = -1) -> bytes:
        time.sleep(self._delay)
        return self._f.read(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class SlowFS:
    """An fsspec filesystem whose listing, ``open`` and ``read`` calls cost MS each."""

    def __init__(self, fs, delay_s: float):
        self._fs, self._delay = fs, delay_s

    def find(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._fs.find(*args, **kwargs)

    def open(self, *args, **kwargs):
        time.sleep(self._delay)
        return SlowFile(self._fs.open(*args, **kwargs), self._delay)


def slow_rank(rank: int, cfg_dict: dict, delay_s: float, steps: int, epoch: int, step_s: float, barrier, out) -> None:
    """Data rank ``rank`` of 2 over the slow store: ``steps`` steps of ``step_s`` compute; its data waits and its
    read counters after the first ``epoch`` steps and at the end."""
    from difftrain.data.store import node_cache
    from difftrain.data.store.loader import StoreLoader

    real = node_cache.store_fs
    node_cache.store_fs = lambda uri: (SlowFS(real(uri)[0], delay_s), real(uri)[1])
    loader = StoreLoader(from_dict(cfg_dict), lambda p: {"ids": torch.zeros(len(p), 1, dtype=torch.long)}, rank, 2)
    for t in loader.tables.values():
        t.ds = SlowDataset(t.ds, delay_s)
    barrier.wait(300)
    waits, first = [], None
    for step in range(steps):
        t0 = time.perf_counter()
        next(loader)
        waits.append(time.perf_counter() - t0)
        time.sleep(step_s)                        # the training step's compute
        if step + 1 == epoch:
            first = loader.cache_stats()
    out.put({"rank": rank, "waits": waits, "first": first, "stats": loader.cache_stats()})
    loader.close()


def slow_store_part(root: Path, args) -> dict:
    """Two data ranks over a slow store, without a cache and with a cold node cache they share."""
    import multiprocessing as mp

    store = str(root / "slow-store")
    gb, side, n, ms = args.slow_gb, 256, args.slow_n, args.slow_store_ms
    base = {"autoencoder": {"kind": "pixel-unshuffle", "factor": 8}, "train": {"global_batch": gb},
            "data": {"source": "store", "store": store, "read_threads": 2, "prefetch": 4, "caption_dropout": 0.0,
                     "stages": [{"name": "s", "start_step": 0, "buckets": [[side, side]], "global_batch": gb}]}}
    cfg = from_dict(base)
    stage = parse_stages(cfg)[0]
    b = stage.buckets[0]
    shape = [1, 192, side // 8, side // 8]                      # 384 KiB of bf16 a sample
    info = st.TableInfo(st.table_name("s", b.name, "t2i"), "s", b.name, "t2i", 1, shape,
                        st.cache_key(cfg, stage, b, "t2i"), False)
    rng = np.random.default_rng(0)
    for lo in range(0, n, 32):                                  # fragments of 32 samples (12 MiB)
        k = min(32, n - lo)
        st.write_table(store, info, {"sample_id": list(range(lo, lo + k)), "caption": ["a photo"] * k,
                                     "latents": [rng.standard_normal(shape, dtype=np.float32) for _ in range(k)]})
    table_bytes = sum(f.stat().st_size for f in (Path(store) / "tables").rglob("*") if f.is_file())
    epoch = n // gb
    steps = args.slow_epochs * epoch
    if os.environ.get("DIFFTRAIN_MAX_STEPS"):     # docs/configuration.md: the docs' tests run every command short
        steps = max(3, min(steps, int(os.environ["DIFFTRAIN_MAX_STEPS"])))
        epoch = min(epoch, steps - 1)
    cache_root = Path(args.slow_cache_dir) if args.slow_cache_dir else root
    ctx = mp.get_context("spawn")
    out = {"slow_store_ms": ms, "slow_step_ms": args.slow_step_ms, "slow_global_batch": gb, "slow_steps": steps,
           "slow_epochs": args.slow_epochs, "slow_table_mb": round(table_bytes / 1e6, 1),
           "slow_cache_lookahead": args.slow_lookahead, "slow_cache_dir": str(cache_root)}
    runs = [("floor", None), ("off", None), ("on", 2 * table_bytes)]
    runs += [("half", table_bytes / 2)] if args.slow_half else []
    for mode, limit in runs:
        delay_s = 0.0 if mode == "floor" else ms / 1e3
        data = dict(base["data"])
        if limit:
            cache = Path(tempfile.mkdtemp(prefix="node-cache-", dir=cache_root))
            data.update(cache_dir=str(cache), cache_gb=limit / 1e9, cache_lookahead=args.slow_lookahead)
        barrier, q = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=slow_rank, args=(r, dict(base, data=data), delay_s, steps, epoch,
                                                      args.slow_step_ms / 1e3, barrier, q)) for r in range(2)]
        for p in procs:
            p.start()
        reports = [q.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join()
        if limit:
            shutil.rmtree(cache, ignore_errors=True)
        step_s = args.slow_step_ms / 1e3

        def wait_fraction(lo: int, hi: int) -> float:   # over both ranks' steps lo..hi-1
            wait = sum(sum(r["waits"][lo:hi]) for r in reports)
            return round(wait / (wait + 2 * (hi - lo) * step_s), 4)

        def totals(key: str) -> dict:
            return {k: sum(r[key][k] for r in reports) for k in ("rows", "rows_local", "bytes", "store_bytes_read")}

        if mode == "floor":                      # the same two ranks, no delay, no cache: this machine's floor
            out["data_wait_store_without_delay"] = wait_fraction(1, steps)
            continue
        name = {"off": "cache_off", "on": "cache_on", "half": "half_table_cache"}[mode]
        out[f"slow_store_data_wait_{name}"] = wait_fraction(1, steps)           # the first step is start-up
        out[f"slow_store_data_wait_{name}_first_epoch"] = wait_fraction(1, epoch)
        out[f"slow_store_data_wait_{name}_after_first_epoch"] = wait_fraction(epoch, steps)
        if limit:
            prefix = "" if mode == "on" else f"{name}_"
            s, f = totals("stats"), totals("first")
            out[f"{prefix}cache_hit_rate"] = round(s["rows_local"] / s["rows"], 4)
            out[f"{prefix}store_bytes_read_over_bytes_served"] = round(s["store_bytes_read"] / s["bytes"], 4)
            out[f"{prefix}cache_hit_rate_first_epoch"] = round(f["rows_local"] / f["rows"], 4)
            out[f"{prefix}store_bytes_read_over_bytes_served_first_epoch"] = round(f["store_bytes_read"] / f["bytes"],
                                                                                    4)
            out[f"{prefix}cache_fragments_copied"] = sum(r["stats"]["units_copied"] for r in reports)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1024, help="samples in the 1024^2 store (512 KiB each)")
    ap.add_argument("--fly", type=int, default=24, help="images for the on-the-fly comparison")
    ap.add_argument("--threads", type=int, default=8, help="loader read threads")
    ap.add_argument("--parts", default="bandwidth,fly,train",
                    help="comma-separated: bandwidth (1024^2 store vs raw reads), fly (vs on-the-fly encoding), "
                         "train (export -> prepare -> train from the store), slow (the node cache over a slow "
                         "store; --slow-store-ms adds it)")
    ap.add_argument("--train-steps", type=int, default=300, help="training steps of the train part")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--slow-store-ms", type=float, default=0.0,
                    help="run the slow-store part: every read call on the shared store delayed by MS ms")
    ap.add_argument("--slow-n", type=int, default=1024, help="samples in the slow-store table (384 KiB each)")
    ap.add_argument("--slow-gb", type=int, default=32, help="global batch of the slow-store part (two ranks)")
    ap.add_argument("--slow-epochs", type=int, default=4, help="epochs of that table the two ranks read")
    ap.add_argument("--slow-step-ms", type=float, default=100.0, help="simulated compute time of a training step")
    ap.add_argument("--slow-lookahead", type=int, default=32, help="data.cache_lookahead of the slow-store part")
    ap.add_argument("--slow-cache-dir", default="", help="where the node cache goes (default: the work directory)")
    ap.add_argument("--slow-half", action="store_true",
                    help="also run with a node cache of half the table (the regime of a table that does not fit)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if args.slow_store_ms > 0:
        parts.add("slow")
    elif "slow" in parts:
        ap.error("--parts slow needs --slow-store-ms MS (the delay of each read call on the shared store)")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        out = {}
        if parts & {"bandwidth", "fly"}:
            vae = vae_dir(root)
        if "bandwidth" in parts:
            out.update(bandwidth_part(root, vae, args.n, args.threads))
        if "fly" in parts:
            out.update(on_the_fly_part(root, vae, args.fly, args.threads))
        if "train" in parts:
            out.update(train_part(root, args.train_steps))
        if "slow" in parts:
            out.update(slow_store_part(root, args))
        print(json.dumps(out))


if __name__ == "__main__":
    main()
