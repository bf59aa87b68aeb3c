"""What quantized inference costs in quality: the demo's checkpoint sampled in fp32, in bf16 and in each format of
``difftrain sample --quant`` (fp8, mxfp8, nvfp4) on the same prompts and noise, judged by the shapes evaluator.

For each format: every accuracy of ``difftrain eval`` (text-to-image colour, position, shape, size, edits,
keyframes, training and held-out splits) and ``acc_drop_pp_<fmt>``, the largest drop from fp32 among them, in
percentage points; ``latent_mse_<fmt>``, the mean squared difference of the generated latents from fp32's (the
same prompts, seeds and steps) and ``latent_rel_rmse_<fmt>``, its root over fp32's RMS; ``psnr_<fmt>``, the PSNR in dB of the decoded images against fp32's (8-bit
pixels); ``mode_<fmt>`` ("native" where this machine has the format, "emulated" in bf16 elsewhere); the bytes of the
quantized weights; seconds. fp8 is to lose at most 3 points (``acc_drop_ok_fp8``); mxfp8 and nvfp4 are reported.

    python bench/quant_shapes.py [--base demo-out/run] [--n 256] [--formats bf16 fp8 mxfp8 nvfp4]

Without ``--base`` (or when it is missing) the demo is run first (``difftrain demo``, ~15 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

FP8_BOUND_PP = 3.0


def base_run(base: str | None, root: Path) -> Path:
    if base and Path(base).exists():
        return Path(base).resolve()
    subprocess.run([sys.executable, "-m", "difftrain", "demo", "--out", str(root / "demo"), "--no-progress"],
                   check=True, capture_output=True)
    return (root / "demo" / "run").resolve()


def generate(run: Path, fmt: str, n: int) -> tuple[dict, list[torch.Tensor], np.ndarray, dict, float]:
    """The evaluation at ``fmt`` ('fp32', 'bf16' or a --quant format): metrics, every sampled latent (in call
    order), every generated image, the quantization report, seconds."""
    from difftrain.evaluate import evaluate_buckets
    from difftrain.inference import guidance_scale, load_pipeline

    t0 = time.perf_counter()
    pipe, cfg, info = load_pipeline(run, device=torch.device("cpu"), quant=fmt if fmt not in ("fp32", "bf16") else None)
    if fmt == "bf16":
        pipe.model.to(torch.bfloat16)
        pipe.amp_dtype = torch.bfloat16
    latents: list[torch.Tensor] = []
    images: list[np.ndarray] = []
    sample = pipe.sample

    def recording(batch, *args, **kwargs):       # the generated frames of each call (not the given ones)
        out = sample(batch, *args, **kwargs)
        made = batch.loss_mask_BL.reshape(out.shape[0], out.shape[1], -1).any(-1).cpu()
        latents.append(out.detach().float().cpu()[made])
        images.append(pipe.to_images(out)[made.numpy()])
        return out
    pipe.sample = recording
    metrics, _ = evaluate_buckets(pipe, cfg, cfg.eval.seed, n, cfg.sample.steps, guidance_scale(cfg, None),
                                  cfg.sample.seed)
    return metrics, latents, np.concatenate(images), info.get("quant", {}), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="the demo's run directory (default: run the demo first)")
    ap.add_argument("--n", type=int, default=256, help="prompts per task (default 256)")
    ap.add_argument("--formats", nargs="+", default=["bf16", "fp8", "mxfp8", "nvfp4"])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run = base_run(a.base, Path(tmp))
        ref, ref_lat, ref_img, _, secs = generate(run, "fp32", a.n)
        accs = [k for k, v in ref.items() if v is not None and (k.endswith("_acc") or k.endswith("_rate") or "_acc_" in k)]
        out: dict = {"run": str(run), "n": a.n, "fp32": {k: ref[k] for k in accs}, "seconds_fp32": round(secs, 1)}
        for fmt in a.formats:
            m, lat, img, q, secs = generate(run, fmt, a.n)
            drops = {k: round(100 * (ref[k] - m[k]), 2) for k in accs}
            worst = max(drops, key=drops.get)
            ref_flat = torch.cat([x.flatten() for x in ref_lat])
            mse = float(torch.cat([x.flatten() for x in lat]).sub(ref_flat).pow(2).mean())
            pix = float(np.mean((img.astype(np.float64) - ref_img.astype(np.float64)) ** 2))
            out[fmt] = {k: m[k] for k in accs}
            out[f"acc_drop_pp_{fmt}"] = drops[worst]
            out[f"acc_drop_key_{fmt}"] = worst
            out[f"latent_mse_{fmt}"] = float(f"{mse:.3g}")
            out[f"latent_rel_rmse_{fmt}"] = float(f"{(mse / float(ref_flat.pow(2).mean())) ** 0.5:.3g}")
            out[f"psnr_{fmt}"] = round(10 * np.log10(255.0 ** 2 / pix), 2) if pix > 0 else float("inf")
            out[f"mode_{fmt}"] = q.get("mode", "native" if fmt == "bf16" else "")
            if q:
                out[f"weight_bytes_{fmt}"] = q["weight_bytes"]
            out[f"seconds_{fmt}"] = round(secs, 1)
            print(json.dumps({k: v for k, v in out.items() if k.endswith(fmt)}), file=sys.stderr, flush=True)
        if "fp8" in a.formats:
            out["acc_drop_ok_fp8"] = out["acc_drop_pp_fp8"] <= FP8_BOUND_PP
    print(json.dumps(out))


if __name__ == "__main__":
    main()
