"""Quantized inference of the DiT (``difftrain sample|eval --quant``), through torchao.

Formats: ``fp8`` (float8 e4m3 weights with one scale per output row, activations per row), ``mxfp8`` (OCP MX: e4m3
values in blocks of 32 sharing a power-of-two scale, weights and activations), ``nvfp4`` (NVIDIA FP4: e2m1 values in
blocks of 16 with an e4m3 block scale and a float32 tensor scale, weights and activations).

Quantized: the linears of the double and single blocks (both widths multiples of 32), but the modulation linears;
the embedders, the final layer, norms and attention stay in bf16, as published low-precision recipes keep them.
The model runs in bf16 around them.

Where the hardware has the format (fp8: CUDA compute capability 8.9 or later; mxfp8 and nvfp4: 10.0 or later) the
quantized matmuls are torchao's fast kernels ("native"). Elsewhere the same numbers are computed in bf16
("emulated"): weights are stored quantized and dequantized for the matmul, and each quantized layer's input is
quantized and dequantized too (a weight-only emulation understates the error). Emulation is for judging quality,
not speed.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import Tensor, nn

from difftrain.errors import UserError

log = logging.getLogger("difftrain")

FORMATS = ("fp8", "mxfp8", "nvfp4")
NATIVE_CAPABILITY = {"fp8": (8, 9), "mxfp8": (10, 0), "nvfp4": (10, 0)}
BLOCKS = ("double_blocks.", "single_blocks.")
MODULATION = ("_mod.lin", "modulation.lin")
TINY = 1e-12                                     # the least amax a scale is computed from (zeros stay zeros)
MULTIPLE = 32                                    # MX blocks (32) and NVFP4 blocks (16) must tile the rows


def block_linear(module: nn.Module, fqn: str, multiple: int = 16) -> bool:
    """A linear of the DiT's blocks, not a modulation linear, with both widths multiples of ``multiple``: the layers
    float8 training converts (``multiple`` 16) and quantized inference quantizes (32)."""
    return (isinstance(module, nn.Linear) and fqn.startswith(BLOCKS) and not fqn.endswith(MODULATION)
            and module.in_features % multiple == 0 and module.out_features % multiple == 0)


def eligible(module: nn.Module, fqn: str) -> bool:
    return block_linear(module, fqn, MULTIPLE)


def check_format(fmt: str, where: str = "--quant") -> str:
    if fmt not in FORMATS:
        raise UserError(f"{where} {fmt!r}: expected one of {', '.join(FORMATS)}")
    return fmt


def is_native(fmt: str, device: torch.device) -> bool:
    """Whether ``device`` computes ``fmt`` in hardware (else it is emulated in bf16)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= NATIVE_CAPABILITY[fmt]


def _torchao(fmt: str) -> None:
    import importlib.util
    if importlib.util.find_spec("torchao") is None:
        raise UserError(f"--quant {fmt} needs torchao (pip install torchao==0.18.0, paired with torch 2.13)")


def to_format(x2: Tensor, fmt: str) -> Tensor:
    """``x2`` (rows, C) in ``fmt`` as torchao's tensor type (values and scales along C): fp8 a scale per row, mxfp8
    an e8m0 scale per 32 (rounded as the MX config rounds it, RCEIL), nvfp4 an e4m3 scale per 16 and a tensor
    scale. A row (or tensor) of zeros stays zeros. What activations and weights are quantized by alike."""
    _torchao(fmt)
    if fmt == "fp8":
        from torchao.quantization import Float8Tensor, PerRow
        return Float8Tensor.from_hp(x2, float8_dtype=torch.float8_e4m3fn, granularity=PerRow(), hp_value_lb=TINY)
    if fmt == "mxfp8":
        from torchao.prototype.mx_formats import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        return MXTensor.to_mx(x2, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    scale = per_tensor_amax_to_scale(x2.abs().amax().float().clamp(min=TINY))
    return NVFP4Tensor.to_nvfp4(x2, per_tensor_scale=scale)


def fake_quant(fmt: str) -> Callable[[Tensor], Tensor]:
    """x -> x quantized to ``fmt`` and back, along its last dimension (what a quantized matmul's input goes
    through)."""
    _torchao(fmt)

    def apply(x: Tensor) -> Tensor:
        shape = x.shape
        return to_format(x.reshape(-1, shape[-1]).contiguous(), fmt).dequantize(x.dtype).reshape(shape)
    return apply


def config_for(fmt: str, native: bool):
    """The torchao config that quantizes a layer's weight: the fast kernels' config where ``native``, else a
    config torchao runs on any device (weights stored in the format; activations then fake-quantized by a hook,
    but for mxfp8, whose emulated config quantizes them itself)."""
    _torchao(fmt)
    from torchao.prototype.mx_formats import (MXDynamicActivationMXWeightConfig,
                                              NVFP4DynamicActivationNVFP4WeightConfig, NVFP4WeightOnlyConfig)
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig, PerRow)
    from torchao.quantization.quantize_.common import KernelPreference

    if fmt == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()) if native else Float8WeightOnlyConfig()
    if fmt == "mxfp8":
        return MXDynamicActivationMXWeightConfig(
            block_size=32, activation_dtype=torch.float8_e4m3fn, weight_dtype=torch.float8_e4m3fn,
            kernel_preference=KernelPreference.AUTO if native else KernelPreference.EMULATED)
    return NVFP4DynamicActivationNVFP4WeightConfig() if native else NVFP4WeightOnlyConfig()


def quantize_dit(dit: nn.Module, fmt: str, device: torch.device) -> dict:
    """Quantize ``dit`` (on ``device``, in eval mode) for inference in ``fmt``, in place; the model is cast to bf16
    around the quantized layers. Returns {"format", "mode" ("native" | "emulated"), "layers" (quantized),
    "weight_bytes" (of the quantized layers' weights, before and after)}."""
    check_format(fmt)
    if dit.training or any(p.requires_grad for p in dit.parameters()):
        raise UserError(f"--quant {fmt} quantizes a model for inference: put it in eval mode with gradients off "
                        "(a quantized model is not trained: train.fp8 trains in float8)")
    names = [n for n, m in dit.named_modules() if eligible(m, n)]
    if not names:
        raise UserError(f"--quant {fmt}: no linear layer of the DiT's blocks has widths that are multiples of "
                        f"{MULTIPLE} (model.hidden and the MLP width must be)")
    native = is_native(fmt, device)
    before = sum(dict(dit.named_modules())[n].weight.numel() * 2 for n in names)     # bf16 bytes
    dit.to(torch.bfloat16)
    from torchao.quantization import quantize_

    quantize_(dit, config_for(fmt, native), filter_fn=eligible)
    modules = dict(dit.named_modules())
    if not native and fmt != "mxfp8":            # activations through the format too
        fq = fake_quant(fmt)
        for n in names:
            modules[n].register_forward_pre_hook(lambda _m, args: (fq(args[0]),) + tuple(args[1:]))
    if fmt == "mxfp8" or (native and fmt == "nvfp4"):
        for n in names:                          # torchao's MX/NVFP4 linears take 2-D inputs: (..., C) -> (N, C)
            modules[n].register_forward_pre_hook(_flatten)
            modules[n].register_forward_hook(_unflatten)
    bad = [n for n in names if _dequantized(modules[n].weight).isnan().any()]
    if bad:
        raise UserError(f"--quant {fmt}: quantizing {bad[0]}.weight gave NaN ({len(bad)} layer(s)); the checkpoint's "
                        "weights are not finite or not representable in the format")
    after = sum(_stored_bytes(modules[n].weight) for n in names)
    mode = "native" if native else "emulated"
    log.info("--quant %s: %d linear layers of the DiT quantized (%s%s)", fmt, len(names), mode,
             "" if native else ": computed in bf16, for quality, not speed")
    return {"format": fmt, "mode": mode, "layers": len(names), "weight_bytes": {"bf16": before, fmt: after}}


def _flatten(module: nn.Module, args: tuple) -> tuple:
    module._quant_shape = args[0].shape[:-1]
    return (args[0].reshape(-1, args[0].shape[-1]),) + tuple(args[1:])


def _unflatten(module: nn.Module, _args: tuple, out: Tensor) -> Tensor:
    return out.reshape(*module._quant_shape, out.shape[-1])


def _dequantized(weight: Tensor) -> Tensor:
    return weight.dequantize() if hasattr(weight, "qdata") else weight


def _stored_bytes(weight: Tensor) -> int:
    """Bytes a quantized weight holds: its values and scales (torchao's tensor types keep them as attributes)."""
    total = 0
    for attr in ("qdata", "scale", "per_tensor_scale"):
        t = getattr(weight, attr, None)
        if isinstance(t, Tensor):
            total += t.numel() * t.element_size()
    return total or weight.numel() * weight.element_size()



# --- quantized weights on disk (``difftrain export --quant``) ---------------------------------------------------
# A quantized layer's weight is written as the format's values under the weight's own name, with its scales
# beside it: fp8 "<w>" e4m3 (out, in) and "<w>_scale" float32 (out, 1), one per output row; mxfp8 "<w>" e4m3
# (out, in) and "<w>_scale" e8m0 (out, in / 32), one per block of 32; nvfp4 "<w>" uint8 (out, in / 2), two e2m1
# values a byte, "<w>_scale" e4m3 (out, in / 16) and "<w>_global_scale" float32 (), the tensor's scale.
# The values are those ``quantize_dit`` computes from the bf16 weight (the same torchao functions).
def quantized_entries(shape: tuple[int, ...], fmt: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{suffix: (shape, dtype)} of what a weight of ``shape`` is written as in ``fmt``."""
    o, i = shape
    if fmt == "fp8":
        return {"": ((o, i), torch.float8_e4m3fn), "_scale": ((o, 1), torch.float32)}
    if fmt == "mxfp8":
        return {"": ((o, i), torch.float8_e4m3fn), "_scale": ((o, i // 32), torch.float8_e8m0fnu)}
    return {"": ((o, i // 2), torch.uint8), "_scale": ((o, i // 16), torch.float8_e4m3fn),
            "_global_scale": ((), torch.float32)}


def quantize_weight(weight: Tensor, fmt: str) -> dict[str, Tensor]:
    """{suffix: tensor} of ``weight`` (out, in) quantized to ``fmt`` from bf16, as ``quantized_entries`` lays out."""
    q = to_format(weight.detach().to(torch.bfloat16).contiguous(), fmt)
    rows = weight.shape[0]
    out = {"": q.qdata, "_scale": q.scale.reshape(rows, -1) if fmt != "fp8" else q.scale.float().reshape(rows, 1)}
    if fmt == "nvfp4":
        out["_global_scale"] = q.per_tensor_scale.float()
    return out


def dequantize_entries(values: Tensor, scale: Tensor, fmt: str, global_scale: Tensor | None = None) -> Tensor:
    """The float32 weight that ``quantize_weight``'s tensors stand for (what a reader of a quantized export
    multiplies out): values times their row's (fp8) or block's (mxfp8, nvfp4) scale, times nvfp4's tensor scale."""
    _torchao(fmt)
    if fmt == "nvfp4":
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
        values = f4_unpacked_to_f32(unpack_uint4(values.contiguous().view(torch.uint8)))
        scale = scale.float() * (global_scale.float() if global_scale is not None else 1.0)
    values, scale = values.float(), scale.float()
    return values * scale.repeat_interleave(values.shape[1] // scale.shape[1], dim=1)
