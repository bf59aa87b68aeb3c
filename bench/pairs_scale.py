"""What the DPO pairs cost as the pairs file grows: encoding once, and serving steps from the memory-mapped cache.

For each size, a synthetic pairs file in the layout ``difftrain pairs`` writes (K = 4 candidates a prompt, all 6
pairs of each, every candidate a distinct 64x64 PNG), then, each in a fresh process:
- ``encode``: ``EncodedPairs.load_or_encode`` (pass 1 reads headers, pass 2 encodes each distinct image once with
  the pixel-unshuffle autoencoder into ``PAIRS.encoded/``);
- ``serve``: open the cache and serve ``--steps`` steps of ``--global`` pairs (one rank of ``--ranks``).
Reported per size: seconds per pair to encode, the serving process's steady step time, and each process's peak
anonymous memory (RssAnon, sampled every 2 ms; the page cache of the files it reads or writes is not the process's) above its own baseline after imports (``*_rss_mib``). The cache is read
memory-mapped, so serving memory should stay flat as the file grows (only per-pair index arrays of a few bytes a
pair grow), and encoding memory should grow only with its per-image bookkeeping, not with the latents.

Prints one JSON object: ``serve_bytes_per_pair`` (what a serving rank's memory grows by per pair of the file,
from the smallest size to the largest: its per-pair index arrays, tens of bytes; the latents, hundreds of KiB a pair
at 1024^2, are not in it), ``encode_bytes_per_pair`` (the same for the encoding rank: its per-image bookkeeping),
``encode_seconds_per_pair_ratio`` and ``serve_step_ratio`` (largest over smallest; flat: ~1 or below).

    python bench/pairs_scale.py [--sizes 1200 4800 19200] [--steps 30] [--global 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = r"""
import json, sys, threading, time
import numpy as np
import torch
torch.set_num_threads(1)
from difftrain.data.store.pairs import EncodedPairs
from difftrain.data.store.pairs_loader import PairsLoader
from difftrain.models.autoencoder import build_autoencoder
what, path = sys.argv[1], sys.argv[2]
settings = {"autoencoder": {"kind": "pixel-unshuffle", "factor": 8}, "latent_dtype": "bf16"}
ae = build_autoencoder("pixel-unshuffle", 8)
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
peak, done = [anon()], False
base = peak[0]
def sample():
    while not done:
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
threading.Thread(target=sample, daemon=True).start()
out = {}
if what == "encode":
    t = time.perf_counter()
    EncodedPairs.load_or_encode(path, ae, settings)
    out["seconds"] = time.perf_counter() - t
elif what == "serve":
    steps, glob, ranks = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    enc = EncodedPairs.load_or_encode(path, ae, settings)
    words = lambda ps: {"ids": torch.tensor([[hash(w) % 97 + 2 for w in p.split()][:16] + [0] * (16 - len(p.split()))
                                              for p in ps])}
    loader = PairsLoader(enc, words, glob, 0, 0, ranks, 0)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        batches = next(loader)
        times.append(time.perf_counter() - t)
    assert batches[0].pairs == glob // ranks
    out["step_seconds"] = float(np.median(times[steps // 3:]))
done = True
out["steady_rss_mib"] = (anon() - base) / 1024
out["rss_mib"] = (max(peak[0], anon()) - base) / 1024
print(json.dumps(out))
"""


def make_pairs(folder: Path, pairs: int, size: int = 64) -> Path:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from difftrain.data.store.pairs import PAIR_COLUMNS

    rng = np.random.default_rng(0)
    prompts = -(-pairs // 6)
    rows = []
    for p in range(prompts):
        for k in range(4):
            img = rng.integers(0, 255, size=(size // 8, size // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
            Image.fromarray(img).save(folder / f"{p}-{k}.png", compress_level=1)
        for a in range(4):
            for b in range(a + 1, 4):
                if len(rows) < pairs:
                    rows.append({"pair_id": len(rows), "prompt_id": f"p{p}", "prompt": f"a red circle number {p}",
                                 "task": "t2i", "winner": f"{p}-{a}", "loser": f"{p}-{b}",
                                 "winner_image": f"{p}-{a}.png", "loser_image": f"{p}-{b}.png", "source_image": "",
                                 "winner_seed": a, "loser_seed": b, "agreement": 1.0, "raters": 1,
                                 "split": "train" if p % 20 else "validation"})
    types = {"int64": pa.int64(), "string": pa.string(), "double": pa.float64()}
    schema = pa.schema([(c, types[t]) for c, t in PAIR_COLUMNS.items()])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / "pairs.parquet")
    return folder / "pairs.parquet"


def run(*args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", WORKER, *args], capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1200, 4800, 19200])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global", dest="glob", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=2)
    a = ap.parse_args()
    result = {"sizes": a.sizes, "per_size": []}
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.sizes:
            folder = Path(tmp) / str(n)
            folder.mkdir()
            path = make_pairs(folder, n)
            enc = run("encode", str(path))
            serve = run("serve", str(path), str(a.steps), str(a.glob), str(a.ranks))
            cache = sum(f.stat().st_size for f in (folder / "pairs.parquet.encoded").iterdir())
            result["per_size"].append({"pairs": n, "encode_seconds_per_pair": round(enc["seconds"] / n, 6),
                                       "encode_rss_mib": round(enc["rss_mib"], 1),
                                       "serve_step_seconds": round(serve["step_seconds"], 5),
                                       "serve_rss_mib": round(serve["rss_mib"], 1),
                                       "serve_steady_rss_mib": round(serve["steady_rss_mib"], 1),
                                       "cache_mib": round(cache / 2**20, 1)})
            print(json.dumps(result["per_size"][-1]), file=sys.stderr)
    first, last = result["per_size"][0], result["per_size"][-1]
    grown = last["pairs"] - first["pairs"]
    result["serve_bytes_per_pair"] = round((last["serve_rss_mib"] - first["serve_rss_mib"]) * 2**20 / grown, 1)
    result["encode_bytes_per_pair"] = round((last["encode_rss_mib"] - first["encode_rss_mib"]) * 2**20 / grown, 1)
    result["encode_seconds_per_pair_ratio"] = round(last["encode_seconds_per_pair"] / first["encode_seconds_per_pair"], 3)
    result["serve_step_ratio"] = round(last["serve_step_seconds"] / first["serve_step_seconds"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
