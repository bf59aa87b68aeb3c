"""Float8 training against bf16 over the same steps: the shapes-tiny preset trained twice from the same seed, once
with train.fp8 (the blocks' linears in float8) and once without, both under bf16 autocast; the loss curves side by
side (means over windows of steps) and the difference of the last window. A GPU benchmark: on a CPU float8 under
bf16 autocast is emulated at ~90 s a step of shapes-tiny (bf16 alone: 0.19 s), so there use a few steps only.

    python bench/fp8_train.py [--steps 300] [--recipe tensorwise] [--window 50]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    from difftrain.config import load_config, preset_path
    from difftrain.train import build_trainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--recipe", default="tensorwise", choices=("tensorwise", "rowwise"))
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    out = {"steps": a.steps, "recipe": a.recipe, "window": a.window}
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fp8 in (("bf16", "none"), ("fp8", a.recipe)):
            cfg = load_config(preset_path("shapes-tiny"), [f"train.fp8={fp8}", f"train.steps={a.steps}",
                                                           "train.minutes=0", "train.precision=bf16",
                                                           "train.checkpoint_every=0", "train.sample_every=0",
                                                           f"train.threads={a.threads}", "train.log_every=1"])
            t = time.perf_counter()
            tr = build_trainer(cfg, Path(tmp) / name)
            tr.fit()
            out[f"{name}_seconds"] = round(time.perf_counter() - t, 1)
            rows = [json.loads(x) for x in (Path(tmp) / name / "metrics.jsonl").read_text().splitlines()]
            curves[name] = [r["loss"] for r in rows if "loss" in r]
    w = a.window
    windows = {k: [round(sum(v[i:i + w]) / len(v[i:i + w]), 5) for i in range(0, len(v), w)] for k, v in curves.items()}
    out["loss_windows"] = windows
    out["last_window_loss_delta"] = round(windows["fp8"][-1] - windows["bf16"][-1], 5)
    out["last_window_loss_rel_delta"] = round(out["last_window_loss_delta"] / windows["bf16"][-1], 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
