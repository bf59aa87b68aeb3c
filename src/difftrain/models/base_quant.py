"""A quantized frozen base for adapter training (``adapter.base_precision``), through torchao, weight-only.

- ``fp8``: float8 e4m3 weights with one scale per output row (``Float8WeightOnlyConfig``): 1 byte a weight.
- ``nf4``: 4-bit NormalFloat in blocks of 64 with double-quantized scales (``NF4WeightOnlyConfig``, QLoRA's
  format): about 0.52 bytes a weight. The scales are quantized in blocks of 256 (QLoRA's), or of 128 or 64 where a
  weight's blocks of 64 do not come in whole 256s (a width of 192: every layer of the shapes models), so that every
  block linear whose size is a multiple of 64 x 64 is held in nf4; a smaller one stays in full precision.

Quantized: every frozen linear of the double and single blocks (an adapted layer's ``base_layer``, and the linears
no adapter targets, the modulation's included: a sixth of FLUX's weights), but for fp8 a layer with a row of zeros
(its scale would be 0 / 0: an untrained adaLN-zero modulation), which stays in full precision; the embedders, the final layer, norms and
biases stay in full precision, as do the adapters. Weights are dequantized for each matmul (in the run's compute
dtype), in the forward and again in the backward (``_FrozenQuantizedLinear``: no layer's dequantized weight waits
for the backward), so gradients reach the adapters through the quantized base as through the full one.

Each layer is quantized as its weights are read (``parallel.pretrained.load_pretrained``'s ``on_loaded``): the base
is never held whole in full precision. Under FSDP2 the quantized weights are not sharded (each rank holds the whole
quantized base, as QLoRA on data parallelism does); everything else, the adapters among it, is sharded as usual.
"""

from __future__ import annotations

import functools

import contextlib
import io
import types

import torch
import torch.nn.functional as F
from torch import nn

from difftrain.errors import UserError

PRECISIONS = ("fp8", "nf4")
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
NF4_SCALER_BLOCKS = (256, 128, 64)      # the first that divides a weight's count of 64-value blocks
BLOCKS = ("double_blocks.", "single_blocks.")


def _config(precision: str, scaler_block: int = NF4_SCALER_BLOCK):
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        if precision == "fp8":
            from torchao.quantization import Float8WeightOnlyConfig
            return Float8WeightOnlyConfig()
        from torchao.prototype._nf4tensor_api import NF4WeightOnlyConfig
        config = NF4WeightOnlyConfig()
        config.block_size, config.scaler_block_size = NF4_BLOCK, scaler_block
        return config


def nf4_scaler_block(shape: tuple[int, ...]) -> int | None:
    """The scaler block (``NF4_SCALER_BLOCKS``) a weight of this shape is held with in nf4; None when none fits."""
    n = 1
    for d in shape:
        n *= d
    if n % NF4_BLOCK:
        return None
    return next((s for s in NF4_SCALER_BLOCKS if (n // NF4_BLOCK) % s == 0), None)


def check_base_precision(precision: str, device: torch.device) -> None:
    """Refuse, in one line naming the key, a precision torchao or this device cannot give: torchao missing, or a
    trial quantization of a small layer (forward and backward) failing here. The trial runs once a process for each
    precision and device (every entry point's build asks)."""
    if precision not in PRECISIONS:
        return
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise UserError(f"adapter.base_precision = {precision!r} needs torchao: pip install 'difftrain[fp8]' (torchao "
                        "0.18 for torch 2.13)") from None
    _trial(precision, str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _trial(precision: str, device: str) -> None:
    """The trial itself (a failure is not cached: it raises)."""
    try:
        layer = nn.Linear(256, 128).to(device)
        quantize_layer(layer, precision)
        x = torch.randn(2, 256, device=device, requires_grad=True)
        layer(x).sum().backward()
    except Exception as e:  # noqa: BLE001 -- whatever torchao raises on this device
        raise UserError(f"adapter.base_precision = {precision!r}: torchao cannot quantize and run a layer on "
                        f"{device} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); use 'bf16'") from None


def fits(shape: tuple[int, ...], precision: str) -> bool:
    """Whether a weight of this shape can be held in ``precision`` (nf4 needs whole blocks of 64 x 64 values at least:
    ``nf4_scaler_block``)."""
    return precision == "fp8" or nf4_scaler_block(shape) is not None


def base_layers(dit: nn.Module, precision: str) -> dict[str, nn.Linear]:
    """The frozen linears of the blocks to quantize, by their weight's plain-model name (``x.qkv.weight`` for an
    adapted layer's ``x.qkv.base_layer``)."""
    from difftrain.models.lora import base_name

    out = {}
    for name, m in dit.named_modules():
        if (isinstance(m, nn.Linear) and name.startswith(BLOCKS) and ".lora_" not in name
                and not m.weight.requires_grad and fits(tuple(m.weight.shape), precision)):
            out[base_name(f"{name}.weight")] = m
    return out


def dequantized(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A quantized weight in full precision (a new tensor, freed after its use)."""
    w = weight.get_original_weight() if hasattr(weight, "get_original_weight") else weight.dequantize()
    return w.to(dtype)


CHUNK_ELEMENTS = 1 << 22      # rows dequantized together: 16 MB of fp32 (NF4's dequantization peaks at ~5x that)


def pieces(weight: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """(first row, end row, quantized piece) covering ``weight`` by rows, each about ``CHUNK_ELEMENTS`` values: NF4
    splits on whole scaler blocks (64 x the weight's scaler block of values), fp8 on any row."""
    import math as _math

    rows, cols = weight.shape
    step = NF4_BLOCK * weight.scaler_block_size if hasattr(weight, "get_original_weight") else 1
    unit = step // _math.gcd(step, cols)                 # rows whose values fill whole blocks
    if rows * cols <= CHUNK_ELEMENTS or rows % unit:
        return [(0, rows, weight)]
    # equal pieces (NF4's split takes no remainder): the most rows, a multiple of ``unit`` dividing ``rows``
    k = max((d for d in range(unit, rows + 1, unit) if rows % d == 0 and d * cols <= CHUNK_ELEMENTS), default=unit)
    parts = weight.split(k) if step > 1 else [weight[a:a + k] for a in range(0, rows, k)]
    out, at = [], 0
    for part in parts:
        out.append((at, at + part.shape[0], part))
        at += part.shape[0]
    return out


class _FrozenQuantizedLinear(torch.autograd.Function):
    """y = x W^T + b with W quantized and frozen. Autograd through a plain ``F.linear`` would keep each layer's
    dequantized weight until the backward, in full precision: the whole base again, which is what quantizing it
    was meant to avoid. This keeps the quantized weight and dequantizes it again for the input's gradient (as
    QLoRA's 4-bit matmul does), a few rows at a time (``pieces``): one piece's full-precision values alive at once."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight = weight
        y = torch.cat([F.linear(x, dequantized(w, x.dtype)) for _, _, w in pieces(weight)], dim=-1)
        return y if bias is None else y + bias.to(y.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        grad = None
        for a, b, w in pieces(ctx.weight):
            part = grad_out[..., a:b] @ dequantized(w, grad_out.dtype)
            grad = part if grad is None else grad.add_(part)
        return grad, None, None


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    with torch.autocast(x.device.type, enabled=False):
        return _FrozenQuantizedLinear.apply(x, self.weight, self.bias)


def to_empty_but(module: nn.Module, layers: dict[str, nn.Linear], device) -> None:
    """``module.to_empty(device)`` but for ``layers``' weights, which stay on the meta device to be allocated one at a
    time (``allocate``) as they are read: a base to quantize is never whole in full precision on the device."""
    held = {name: layer._parameters.pop("weight") for name, layer in layers.items()}
    module.to_empty(device=device)
    for name, w in held.items():
        layers[name].register_parameter("weight", w)


def allocate(layer: nn.Linear, device) -> torch.Tensor:
    """A layer's weight, still on the meta device, allocated (frozen, uninitialised) on ``device`` to be read into."""
    w = layer.weight
    layer.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device=device), requires_grad=False)
    return layer.weight.data


def quantize_layer(module: nn.Linear, precision: str) -> None:
    """Replace ``module``'s weight by its quantized form (in place; the module object stays, so a peft wrapper
    holding it as its base layer sees the change), computed by ``_FrozenQuantizedLinear``."""
    from torchao.quantization import quantize_

    if precision == "fp8" and bool((module.weight.detach().abs().amax(dim=1) == 0).any()):
        return          # a row of zeros has no fp8 scale (0 / 0): such a layer stays in full precision
    with contextlib.redirect_stderr(io.StringIO()):
        scaler = nf4_scaler_block(tuple(module.weight.shape)) if precision == "nf4" else NF4_SCALER_BLOCK
        if scaler is None:
            raise ValueError(f"a weight of shape {tuple(module.weight.shape)} is not whole nf4 blocks (64 x 64)")
        quantize_(module, _config(precision, scaler), filter_fn=lambda m, fqn: m is module)
    module.weight.requires_grad_(False)
    if module.bias is not None:
        module.bias.requires_grad_(False)
    module.forward = types.MethodType(_forward, module)


def adopt_quantized(module: nn.Linear, weight: torch.Tensor) -> None:
    """Put a weight another rank quantized (``parallel.node_share``) in ``module``, as ``quantize_layer`` leaves it: a
    quantized one computed by ``_FrozenQuantizedLinear``, a full-precision one (an fp8 layer with a zero row) as is."""
    module.weight = nn.Parameter(weight, requires_grad=False)
    if module.bias is not None:
        module.bias.requires_grad_(False)
    if type(weight) is not torch.Tensor:
        module.forward = types.MethodType(_forward, module)


def stored_bytes(module: nn.Module) -> int:
    """Bytes of the module's parameters as stored (a quantized weight's data and scales)."""
    total = 0
    for p in module.parameters():
        inner = getattr(p, "__tensor_flatten__", None)
        if inner is not None:
            names, _ = p.__tensor_flatten__()
            total += sum(getattr(p, n).numel() * getattr(p, n).element_size() for n in names)
        else:
            total += p.numel() * p.element_size()
    return total


M_MMAP_THRESHOLD = -3          # glibc's mallopt parameter
MMAP_THRESHOLD = 1 << 20


def mmap_large_allocations() -> bool:
    """On a CPU, allocations of 1 MiB and more taken from (and returned to) the system directly (glibc ``mallopt``):
    glibc otherwise raises its mmap threshold to 32 MB as large buffers are freed, and serves the dequantized pieces
    of a quantized base (16 MB each, a new set every layer, forward and backward) from a heap it does not shrink.
    False where unavailable."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return bool(ctypes.CDLL(name).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) if name else False
    except (OSError, AttributeError):
        return False


def release_freed_memory() -> bool:
    """Hand the heap's freed pages back to the system (glibc ``malloc_trim``): the full-precision weights a
    quantized base was read through were freed layer by layer, but glibc keeps freed chunks under its mmap threshold
    (up to 32 MB: most of a base's layers) in the heap, where they would stay resident. False where unavailable."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return bool(ctypes.CDLL(name).malloc_trim(0)) if name else False
    except (OSError, AttributeError):
        return False
