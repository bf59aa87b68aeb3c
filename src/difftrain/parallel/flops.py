"""Model FLOPs of the MMDiT and model FLOPs utilisation (MFU).

MFU is only comparable across runs and with published figures (REFERENCES.md) if the numerator is
*model* FLOPs from a formula, not whatever a kernel happens to execute (flash attention's score
recompute, padding, activation-checkpoint replays are all excluded). The formula, for one sample
with L image tokens, T text tokens, S = T + L, hidden D, MLP width M = int(D * mlp_ratio):

    forward = sum over Linears applied per token of 2 * in * out * tokens
            + sum over Linears applied per sample of 2 * in * out
            + attention: 2 * 2 * S^2 * D per attention layer (QK^T and AV)

where, concretely,
    per token   img_in 2*C*D*L, txt_in 2*text_dim*D*T, pos_in 2*48*D*L (if abs_pos_embed),
                each double block 2*(4D^2 + 2DM)*L (img weights) + 2*(4D^2 + 2DM)*T (txt weights),
                each single block 2*(4D^2 + 2DM)*S (linear1 D->3D+M, linear2 D+M->D),
                less, in the last block, what its T text rows skip (they are keys and values only): a last
                single block's linear2 2*(D^2 + DM)*T, a last double block's proj and MLP 2*(D^2 + 2DM)*T,
                final linear 2*D*C*L;
    per sample  time_in 2*(256D + D^2), vector_in 2*(pooled*D + D^2), guidance_in 2*(256D + D^2),
                double-block adaLN 2*2*D*6D, single-block adaLN 2*D*3D, final adaLN 2*D*2D;
    attention   4*S^2*D for each double and each single block (joint attention over [text; image]).

Elementwise work (norms, RoPE, activations, softmax, modulation) is ignored; encoders and the VAE
are excluded; the caller passes real (unpadded) token counts. Training = 3 x forward (backward is
2 x forward: gradients with respect to inputs and to weights), the convention of PaLM and
torchtitan, which matches REFERENCES.md's 6*N*tokens + 12*layers*D*S^2.
"""

from __future__ import annotations

import functools
import time

import torch

from difftrain.models.dit import DiTParams

# Dense bf16 tensor-core peaks (spec sheets, without sparsity; REFERENCES.md). FP8 is 2x.
PEAK_BF16_FLOPS: dict[str, float] = {"H100": 989e12, "H200": 989e12, "B200": 2.25e15, "GB200": 2.5e15}

# The H100/H200 figures are the SXM parts; PCIe and NVL cards have lower clocks and power, so
# matching them to the SXM peak would understate MFU. They need an explicit override.
_SXM_ONLY = {"H100", "H200"}
_LOWER_VARIANTS = ("PCIE", "NVL")

_TIMESTEP_DIM = 256       # timestep_embedding width fed to time_in / guidance_in (layers.py)
_POS_FEATURES = 6 * 8     # PositionEmbedder: sin/cos x 3 ids x 8 frequencies (layers.py default)

_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)}


def _linear(d_in: int, d_out: int) -> int:
    """FLOPs of one Linear on one row: a multiply and an add per weight (bias adds ignored)."""
    return 2 * d_in * d_out


def forward_flops(params: DiTParams, img_tokens: int, txt_tokens: int) -> int:
    """Forward model FLOPs of the DiT for ONE sample of ``img_tokens`` image and ``txt_tokens`` text
    tokens, by the formula in the module docstring."""
    if img_tokens < 0 or txt_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got img {img_tokens}, txt {txt_tokens}")
    p, D, L, T = params, params.hidden, img_tokens, txt_tokens
    S, M = L + T, int(params.hidden * params.mlp_ratio)
    # qkv (D->3D) + proj (D->D) + MLP (D->M->D), or equally linear1 (D->3D+M) + linear2 (D+M->D).
    block_per_token = _linear(D, 3 * D) + _linear(D, D) + _linear(D, M) + _linear(M, D)
    attention = 2 * 2 * S * S * D

    per_token = _linear(p.in_channels, D) * L + _linear(p.text_dim, D) * T + _linear(D, p.in_channels) * L
    if p.abs_pos_embed:
        per_token += _linear(_POS_FEATURES, D) * L
    per_token += p.double_blocks * block_per_token * (L + T) + p.single_blocks * block_per_token * S
    # The last block's text rows feed only its attention (keys and values): their MLP and output projection are
    # skipped (the single block's fused linear1 still runs on them; a last double block runs only their qkv).
    if p.single_blocks:
        per_token -= (_linear(D, D) + _linear(M, D)) * T
    elif p.double_blocks:
        per_token -= (_linear(D, D) + _linear(D, M) + _linear(M, D)) * T

    per_sample = _linear(_TIMESTEP_DIM, D) + _linear(D, D) + _linear(p.pooled_dim, D) + _linear(D, D)
    if p.guidance_embed:
        per_sample += _linear(_TIMESTEP_DIM, D) + _linear(D, D)
    per_sample += p.double_blocks * 2 * _linear(D, 6 * D) + p.single_blocks * _linear(D, 3 * D)
    per_sample += _linear(D, 2 * D)

    return per_token + per_sample + (p.double_blocks + p.single_blocks) * attention


def train_flops(params: DiTParams, img_tokens: int, txt_tokens: int) -> int:
    """Forward + backward model FLOPs for one sample: 3 x forward (backward computes both the input
    and the weight gradient of every matmul, each as costly as the forward one)."""
    return 3 * forward_flops(params, img_tokens, txt_tokens)


def step_flops(params: DiTParams, samples: list[tuple[int, int]]) -> int:
    """Training FLOPs of one step over ``samples`` = [(img_tokens, txt_tokens), ...]. Summed per sample
    because attention is quadratic: a mixed-resolution batch is not (mean tokens) x batch size."""
    return sum(train_flops(params, img_tokens=L, txt_tokens=T) for L, T in samples)


def _match_device_name(name: str) -> str | None:
    """The table key a CUDA device name refers to; the longest key first, so 'GB200' is not 'B200'."""
    upper = name.upper()
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in upper:
            if key in _SXM_ONLY and any(v in upper for v in _LOWER_VARIANTS):
                return None
            return key
    return None


@functools.lru_cache(maxsize=None)
def _measured_cpu_gemm(threads: int, n: int = 1024, reps: int = 5) -> float:
    """Best-of-``reps`` fp32 n x n matmul rate in FLOP/s with ``threads`` torch threads. Best rather
    than mean: on a shared machine the fastest run is the closest to what the CPU can do. Cached
    per process (and thread count) because it takes a fraction of a second each time."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):                      # warm-up: allocator, BLAS thread pool, caches
        torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / max(best, 1e-9)


def peak_flops(device: torch.device | str, dtype: torch.dtype,
               override: float | None = None) -> tuple[float, str]:
    """Peak FLOP/s per device for MFU, and where the number comes from.

    ``dtype`` is the matmul compute dtype (bf16 under autocast, not the fp32 master weights).
    CUDA: the spec-sheet dense peak of the device named by ``torch.cuda.get_device_name``
    (bf16/fp16 from ``PEAK_BF16_FLOPS``, fp8 twice that). CPU has no meaningful spec peak for this
    purpose, so it returns a measured fp32 GEMM rate: an MFU against it says how close the model
    gets to what this CPU's BLAS actually does. ``override`` (FLOP/s) wins over both, for devices
    not in the table.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak FLOP/s override must be > 0, got {override}")
        return float(override), f"override ({override:.3g} FLOP/s)"
    device = torch.device(device)
    if device.type == "cpu":
        threads = torch.get_num_threads()
        rate = _measured_cpu_gemm(threads)
        return rate, (f"measured fp32 GEMM rate on CPU (1024x1024 matmul, torch threads={threads}; "
                      f"a practical rate, not a spec-sheet peak)")
    if device.type != "cuda":
        raise ValueError(f"no peak FLOP/s known for device type {device.type!r}: pass override=")
    name = torch.cuda.get_device_name(device)
    key = _match_device_name(name)
    if key is None:
        raise ValueError(f"no peak FLOP/s known for CUDA device {name!r} (known: {sorted(PEAK_BF16_FLOPS)}, "
                         f"SXM parts only for H100/H200): pass override= in FLOP/s")
    base = PEAK_BF16_FLOPS[key]
    if dtype in (torch.bfloat16, torch.float16):
        return base, f"{key} dense bf16/fp16 spec peak"
    if dtype in _FP8:
        return 2 * base, f"{key} dense fp8 spec peak (2x bf16)"
    raise ValueError(f"no peak FLOP/s for {dtype} on {name!r} (table holds bf16/fp16 and fp8; fp32/TF32 "
                     f"depends on matmul precision settings): pass override= in FLOP/s")


def mfu(flops_per_step: float, step_seconds: float, world_size: int, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s per device over peak. ``flops_per_step`` is the whole
    global step (all ranks' samples, e.g. ``step_flops`` over the global batch), so it is divided by
    ``world_size`` devices each delivering at most ``peak`` FLOP/s."""
    if step_seconds <= 0 or world_size <= 0 or peak <= 0:
        raise ValueError(f"step_seconds, world_size and peak must be > 0, got {step_seconds}, {world_size}, {peak}")
    return flops_per_step / (step_seconds * world_size * peak)
