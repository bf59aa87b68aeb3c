"""Peak memory of adapter training on a quantized frozen base, against the unquantized base, in one run.

A base large enough for weights to dominate (default: width 2048, 4 double and 8 single blocks, shapes-tiny's text
encoder and autoencoder: ~1.1B parameters, 4.4 GB in fp32) is written as a difftrain export; then, each in a fresh
process, a LoRA (rank 16 on the default targets) trains on it for a few steps with ``adapter.base_precision`` =
``bf16`` (unquantized: fp32 on a CPU), ``fp8`` and ``nf4``, one sample a step. Each child reports its peak resident
memory (``ru_maxrss``: the weights as held, the adapter's optimizer state, activations, and the ~0.5 GB every process
with torch, peft and torchao imported holds) and the median time of its steps after the first.

Prints one JSON object: ``params``, ``base_bytes``; per precision ``peak_rss_gb``, ``baseline_rss_gb`` (after imports),
``step_s``, ``first_loss``; ``peak_ratio_fp8`` and ``peak_ratio_nf4`` (peak over the unquantized run's; targets <= 0.5
and <= 0.35) and ``targets_met``.

    python bench/adapter_memory.py [--dir DIR] [--hidden 2048] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["model.axes_dims_rope=[16, 56, 56]", "model.double_blocks=4", "model.single_blocks=8"]   # head dim 128

BASE = """
import sys
from difftrain.config import load_config, preset_path
from difftrain.train import build_trainer
cfg = load_config(preset_path("shapes-tiny"), sys.argv[2:])
tr = build_trainer(cfg, sys.argv[1])
tr.export()           # the seeded initialisation (no zeroed layer) as the base: its values do not change memory
tr.close()
"""

CHILD = """
import json, os, resource, sys, time
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
from difftrain.config import load_config, preset_path
from difftrain.train import build_trainer
from difftrain.train.metrics import read_metrics
import torch, peft, torchao  # noqa: F401  -- what every run imports, in the baseline
baseline = rss()
cfg = load_config(preset_path("shapes-tiny"), sys.argv[2:])
t0 = time.perf_counter()
tr = build_trainer(cfg, sys.argv[1])
built = time.perf_counter() - t0
tr.fit()
tr.close()
rows = [r for r in read_metrics(sys.argv[1]) if "loss" in r]
times = sorted(r["step_s"] for r in rows[1:]) if len(rows) > 1 else [float("nan")]
assert len(rows) == cfg.train.steps, f"{len(rows)} steps logged, {cfg.train.steps} asked"
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "baseline_rss": baseline,
                  "step_s": times[len(times) // 2], "first_loss": rows[0]["loss"], "build_s": round(built, 1)}))
"""


def _python(code: str, *args: str, threads: int) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"adapter_memory: a child failed:\n{proc.stderr[-3000:]}")
    return (proc.stdout.strip().splitlines() or [""])[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--hidden", type=int, default=2048, help="model width (a multiple of 128; default 2048)")
    ap.add_argument("--steps", type=int, default=4, help="training steps a precision (default 4)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.hidden % 128 or args.steps < 2:
        sys.exit("--hidden must be a multiple of 128 (whole NF4 blocks) and --steps >= 2")
    work = Path(args.dir or tempfile.mkdtemp(prefix="adapter_memory_"))
    common = MODEL + ["model.init=default", f"model.hidden={args.hidden}", f"model.heads={args.hidden // 128}", f"train.threads={args.threads}", "train.global_batch=1",
                      "train.checkpoint_every=0", "train.log_every=1", "train.warmup_steps=0", "train.ema_decay=0",
                      "train.minutes=0"]
    if not (work / "base" / "export" / "model.safetensors").is_file():
        _python(BASE, str(work / "base"), *common, "train.steps=0", threads=args.threads)
    base = work / "base" / "export"
    from safetensors import safe_open
    with safe_open(str(base / "model.safetensors"), "pt") as h:
        params = sum(math.prod(h.get_slice(k).get_shape()) for k in h.keys() if k.startswith("dit."))
    out = {"params": params, "base_bytes": (base / "model.safetensors").stat().st_size, "hidden": args.hidden,
           "steps": args.steps}
    for precision in ("bf16", "fp8", "nf4"):
        shutil.rmtree(work / precision, ignore_errors=True)      # a fresh run: a checkpoint there would be resumed
        got = json.loads(_python(CHILD, str(work / precision), *common, f"train.steps={args.steps}",
                                 "adapter.kind=lora", "adapter.rank=16", "adapter.alpha=16",
                                 f"adapter.base_precision={precision}", f"model.init_from={base}",
                                 threads=args.threads))
        out[precision] = {"peak_rss_gb": round(got["peak_rss"] / 2**30, 3),
                          "baseline_rss_gb": round(got["baseline_rss"] / 2**30, 3), "step_s": round(got["step_s"], 3),
                          "first_loss": round(got["first_loss"], 5), "build_s": got["build_s"]}
    full = out["bf16"]["peak_rss_gb"]
    out["peak_ratio_fp8"] = round(out["fp8"]["peak_rss_gb"] / full, 3)
    out["peak_ratio_nf4"] = round(out["nf4"]["peak_rss_gb"] / full, 3)
    out["targets_met"] = out["peak_ratio_fp8"] <= 0.5 and out["peak_ratio_nf4"] <= 0.35
    print(json.dumps(out))


if __name__ == "__main__":
    main()
