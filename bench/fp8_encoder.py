"""The FP8 frozen text encoder (``text.precision = "fp8"``) against bf16: how close its states are, the memory it
saves and its speed per batch size.

No weights can be downloaded here, so the encoder is a T5 v1.1 (gated-GELU FFN) built from a config with random
weights, and given the activation outliers real T5 checkpoints have (8 FFN channels that carry about half of what
each FFN writes arrive at ``wo`` ``--outlier-scale`` (10^4) times larger than the rest, ``wo``'s weights for them
as much smaller: T5 v1.1's FFN activations are known to overflow fp16 there): random weights without them would
pass any bound and prove nothing. The captions are 256 prompts of the shapes world (text-to-image and edits),
tokenized by ByT5's byte tokenizer.

Figures: ``fp8_encoder_cosine`` (mean over the 256 captions' real tokens of the cosine of each token's state with
the bf16 encoder's) and ``fp8_encoder_cosine_min``; the same with ``wo`` quantized too (``*_wo_quantized``: what
keeping it buys; per-row float8 weights span ~2x10^5 from a row's largest to its least value, so ``wo`` breaks
only past that ratio, as ``tests/test_fp8_text.py`` shows at 10^6); ``fp8_encoder_memory_saved`` (1 - the fp8 encoder's weight bytes / bf16's) and both byte counts;
``ms_per_batch`` for each batch size, bf16 and fp8, and ``fp8_speed_ratio`` (bf16 time / fp8 time; < 1 is slower).
On a CPU torchao's float8 weights are dequantized for each matmul, so fp8 is a memory win and slower; the GPU
suite runs the same measurement on the GPU (``bench/gpu_suite.py``).

    python bench/fp8_encoder.py [--d-model 512] [--layers 6] [--batch-sizes 1 8 32] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

OUTLIER_CHANNELS, OUTLIER_SCALE = 8, 1e4


def captions(n: int = 256) -> list[str]:
    from difftrain.shapes.world import ShapesWorld
    world = ShapesWorld(seed=7)
    return [world.prompt("t2i" if i % 2 == 0 else "edit", i) for i in range(n)]


def build_t5(d_model: int, layers: int, heads: int, d_ff: int, root: str, seed: int = 0,
             outlier_scale: float = OUTLIER_SCALE) -> str:
    """A random T5 v1.1 encoder with FFN activation outliers, saved with its tokenizer under ``root``."""
    import transformers

    torch.manual_seed(seed)
    tok = transformers.ByT5Tokenizer()
    cfg = transformers.T5Config(vocab_size=len(tok), d_model=d_model, d_kv=d_model // heads, d_ff=d_ff,
                                num_layers=layers, num_heads=heads, feed_forward_proj="gated-gelu")
    t5 = transformers.T5EncoderModel(cfg).eval()
    with torch.no_grad():
        for block in t5.encoder.block:
            ff = block.layer[1].DenseReluDense
            k = (d_ff / OUTLIER_CHANNELS) ** 0.5     # 8 channels carry about half of what the FFN writes ...
            ff.wo.weight[:, :OUTLIER_CHANNELS] *= k
            ff.wi_1.weight[:OUTLIER_CHANNELS] *= outlier_scale       # ... arriving that much larger at wo,
            ff.wo.weight[:, :OUTLIER_CHANNELS] /= outlier_scale      # whose weights for them are that much smaller
    t5.save_pretrained(root)
    tok.save_pretrained(root)
    return root


def weight_bytes(module: torch.nn.Module) -> int:
    total = 0
    for p in module.parameters():
        inner = [getattr(p, a) for a in ("qdata", "scale") if isinstance(getattr(p, a, None), torch.Tensor)]
        total += sum(t.numel() * t.element_size() for t in inner) if inner else p.numel() * p.element_size()
    return total


def states(enc, prompts: list[str], batch: int = 32) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            emb = enc(enc.tokenize(prompts[i:i + batch]))
            out.append(emb.txt_BTD[emb.mask_BT].float().cpu())
    return out


def cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.nn.functional.cosine_similarity(x, y, dim=-1) for x, y in zip(a, b)])


def ms_per_batch(enc, prompts: list[str], batch: int, device: torch.device, reps: int) -> float:
    tokens = enc.tokenize(prompts[:batch])
    with torch.no_grad():
        enc(tokens)                                   # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            enc(tokens)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def measure(path: str, device: torch.device, batch_sizes: tuple[int, ...], reps: int, n: int = 256) -> dict:
    """Every figure of the module's docstring for the T5 at ``path`` on ``device`` (bf16 vs fp8)."""
    from difftrain.models.hf_text import HFTextEncoder, quantize_fp8

    prompts = captions(n)
    kw = dict(max_tokens=128, dtype="bf16", device=device)
    bf16 = HFTextEncoder.from_paths(path, "", **kw)
    fp8 = HFTextEncoder.from_paths(path, "", precision="fp8", **kw)
    ref = states(bf16, prompts)
    cos = cosine(states(fp8, prompts), ref)
    naive = HFTextEncoder.from_paths(path, "", **kw)  # wo quantized as well: what keeping it in bf16 buys
    quantize_fp8(naive.t5, keep=())
    cos_naive = cosine(states(naive, prompts), ref)
    del naive
    b_bf16, b_fp8 = weight_bytes(bf16.t5), weight_bytes(fp8.t5)
    out = {"captions": n, "tokens": int(cos.numel()), "fp8_encoder_cosine": round(float(cos.mean()), 5),
           "fp8_encoder_cosine_min": round(float(cos.min()), 5),
           "fp8_encoder_cosine_wo_quantized": round(float(cos_naive.mean()), 5),
           "fp8_encoder_cosine_min_wo_quantized": round(float(cos_naive.min()), 5),
           "weight_bytes_bf16": b_bf16, "weight_bytes_fp8": b_fp8,
           "fp8_encoder_memory_saved": round(1 - b_fp8 / b_bf16, 4), "ms_per_batch": {}}
    for b in batch_sizes:
        t_bf16 = ms_per_batch(bf16, prompts, b, device, reps)
        t_fp8 = ms_per_batch(fp8, prompts, b, device, reps)
        out["ms_per_batch"][str(b)] = {"bf16": round(t_bf16, 2), "fp8": round(t_fp8, 2),
                                       "fp8_speed_ratio": round(t_bf16 / t_fp8, 3)}
    return out


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--outlier-scale", type=float, default=OUTLIER_SCALE)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_t5(a.d_model, a.layers, a.heads, a.d_ff, tmp, outlier_scale=a.outlier_scale)
        out = {"device": a.device, "d_model": a.d_model, "layers": a.layers, "d_ff": a.d_ff,
               "outlier_scale": a.outlier_scale,
               **measure(path, torch.device(a.device), tuple(a.batch_sizes), a.reps)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
