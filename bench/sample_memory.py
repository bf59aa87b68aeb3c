"""Memory of sampling a model bigger than a toy: a ~530M-parameter DiT (shapes-tiny's text and autoencoder, a
hidden size of 1152 with FLUX's head size, 6 double and 12 single blocks) is checkpointed, then loaded by
``difftrain.inference.load_pipeline`` in a fresh process and sampled (one prompt, 2 steps, CPU).

Prints one JSON object: ``params``, ``weight_bytes`` (fp32), ``baseline_rss_mb`` (the process after imports),
``peak_rss_mb`` (its peak), ``peak_anon_mb`` (the peak of its anonymous memory, sampled every 5 ms),
``peak_over_weights_1rank`` = (peak anonymous - baseline anonymous) / weight bytes (target <= 1.3: the weights
once, plus what building and sampling need) and ``peak_rss_over_weights_1rank``, the same from the RSS peak
(the checkpoint is read with plain reads, ``difftrain.parallel.reader``: no file pages are mapped, so the two
agree), ``load_s``, ``sample_s``. Then the same under ``torchrun --nproc-per-node 2`` (gloo, the model
sharded with FSDP2, every linear layer a unit): ``peak_over_weights_2rank`` = the larger of the two ranks'
anonymous growth over the whole model's weight bytes (target <= 0.8: half the weights, plus a layer gathered
at a time and what sampling needs) and ``peak_rss_over_weights_2rank`` from the RSS peaks, run with
``MALLOC_MMAP_THRESHOLD_=1048576`` (see ``MMAP_THRESHOLD``), and ``peak_over_weights_2rank_default_malloc``
without it; ``load_s_2rank``, ``sample_s_2rank``.

    python bench/sample_memory.py [--dir DIR] [--hidden 1152]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WRITE = """
import sys
from difftrain.config import load_config, preset_path
from difftrain.train import build_trainer
cfg = load_config(preset_path("shapes-tiny"), sys.argv[2:])
tr = build_trainer(cfg, sys.argv[1])
tr.save(blocking=True)
tr.close()
"""

# glibc serves allocations under its (growing, up to 32 MiB) mmap threshold from the heap and keeps what is freed
# there: the sharded run's per-block all-gather buffers, freed after every block, then stay in the process (about
# 0.45 x the weights here). Large buffers mmapped are returned when freed; the CPU path is run with this setting.
MMAP_THRESHOLD = 1 << 20

READ = """
import json, os, resource, sys, threading, time, gc
import torch
from difftrain.inference import load_pipeline, request_batch
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))
peak_anon, done = [0], threading.Event()
def watch():
    while not done.wait(0.005):
        peak_anon[0] = max(peak_anon[0], anon())
gc.collect()
base, base_anon = rss(), anon()
threading.Thread(target=watch, daemon=True).start()
t0 = time.perf_counter()
pipe, cfg, _ = load_pipeline(sys.argv[1], device=torch.device("cpu"))
t1 = time.perf_counter()
batch = request_batch(pipe, cfg, ["a small red circle in the top left"])
pipe.to_images(pipe.sample(batch, steps=2, seed=0))
t2 = time.perf_counter()
done.set()
peak_anon[0] = max(peak_anon[0], anon())
dit = pipe.model["dit"]
print(json.dumps({"rank": int(os.environ.get("RANK", "0")), "params": sum(p.numel() for p in dit.parameters()),
                  "weight_bytes": sum(p.numel() * p.element_size() for p in pipe.model.parameters()),
                  "baseline_rss": base, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "baseline_anon": base_anon, "peak_anon": peak_anon[0],
                  "load_s": round(t1 - t0, 1), "sample_s": round(t2 - t1, 1)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where the checkpoint is written (default: a temporary folder)")
    ap.add_argument("--hidden", type=int, default=1152, help="model width (a multiple of 128)")
    args = ap.parse_args()
    sets = [f"model.hidden={args.hidden}", f"model.heads={args.hidden // 128}", "model.double_blocks=6",
            "model.single_blocks=12", "model.axes_dims_rope=[16, 56, 56]", "train.ema_decay=0", "train.steps=1"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        run = str(Path(tmp) / "run")
        subprocess.run([sys.executable, "-c", WRITE, run, *sets], check=True, env=env)
        out = json.loads(subprocess.run([sys.executable, "-c", READ, run], check=True, env=env, capture_output=True,
                                        text=True).stdout.splitlines()[-1])
        script = Path(tmp) / "read.py"
        script.write_text(READ)
        def two_ranks(extra: dict) -> list[dict]:
            two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                  str(script), run], check=True, env={**env, "OMP_NUM_THREADS": "1", **extra},
                                 capture_output=True, text=True).stdout
            return [json.loads(line) for line in two.splitlines() if line.startswith('{"rank"')]
        ranks = two_ranks({"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
        default = two_ranks({})
    grown = out["peak_anon"] - out["baseline_anon"]
    grown2 = max(r["peak_anon"] - r["baseline_anon"] for r in ranks)
    grown2_default = max(r["peak_anon"] - r["baseline_anon"] for r in default)
    print(json.dumps({"params": out["params"], "weight_bytes": out["weight_bytes"],
                      "baseline_rss_mb": round(out["baseline_rss"] / 2**20), "peak_rss_mb": round(out["peak_rss"] / 2**20),
                      "peak_anon_mb": round(out["peak_anon"] / 2**20),
                      "peak_over_weights_1rank": round(grown / out["weight_bytes"], 3),
                      "peak_rss_over_weights_1rank": round((out["peak_rss"] - out["baseline_rss"]) / out["weight_bytes"], 3),
                      "load_s": out["load_s"], "sample_s": out["sample_s"],
                      "peak_over_weights_2rank": round(grown2 / out["weight_bytes"], 3),
                      "malloc_mmap_threshold": MMAP_THRESHOLD,
                      "peak_over_weights_2rank_default_malloc": round(grown2_default / out["weight_bytes"], 3),
                      "peak_rss_over_weights_2rank": round(max(r["peak_rss"] - r["baseline_rss"] for r in ranks)
                                                           / out["weight_bytes"], 3),
                      "peak_anon_mb_by_rank": [round(r["peak_anon"] / 2**20) for r in ranks],
                      "load_s_2rank": max(r["load_s"] for r in ranks),
                      "sample_s_2rank": max(r["sample_s"] for r in ranks)}))


if __name__ == "__main__":
    main()
