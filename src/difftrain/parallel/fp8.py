"""Float8 training of the DiT's block linears (``train.fp8``), through torchao's ``convert_to_float8_training``.

Converted: every ``nn.Linear`` inside the double and single blocks whose input and output widths are multiples of
16, but the modulation linears (a few rows a step: nothing to gain); the embedders and the final layer stay in the
compute dtype, as published float8 recipes keep them. A converted layer keeps its high-precision weight (the
parameter, its gradient and optimizer state, and the checkpoint are unchanged); its matmuls cast inputs, weights
and gradients to float8 with tensorwise or rowwise scales. Converted before FSDP2 wraps the blocks (torchao's
order). Float8 matmuls need CUDA sm89 or later; on a CPU they are emulated (torchao's ``emulate``: the operands cast
to float8 with the recipe's scales, multiplied in float32; the same numbers, not faster).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from difftrain.errors import UserError
from difftrain.models.quant import block_linear

log = logging.getLogger("difftrain")


def eligible(module: nn.Module, fqn: str) -> bool:
    return block_linear(module, fqn, 16)


def apply_fp8(dit: nn.Module, recipe: str, device: torch.device) -> list[str]:
    """Convert ``dit``'s eligible linears for float8 training; the converted layers' names."""
    if recipe == "none":
        return []
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        cap = torch.cuda.get_device_capability(device)
        raise UserError(f"train.fp8 = {recipe!r} needs float8 matmuls (CUDA compute capability 8.9 or later: "
                        f"Ada, Hopper, Blackwell); this GPU is {cap[0]}.{cap[1]}: use train.fp8 = 'none'")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise UserError(f"train.fp8 = {recipe!r} needs torchao (pip install torchao==0.18.0, paired with torch "
                        "2.13)") from None
    names = [n for n, m in dit.named_modules() if eligible(m, n)]
    if not names:
        raise UserError(f"train.fp8 = {recipe!r}: no linear layer of the blocks has widths that are multiples of 16")
    config = Float8LinearConfig.from_recipe_name(recipe)
    if device.type != "cuda":
        # torch._scaled_mm has no fast CPU kernel (~600x a float32 matmul); torchao's emulation casts the operands
        # to float8 with the same scales and multiplies them in float32: the same numbers to ~1e-6, at matmul speed.
        import dataclasses
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(dit, config=config, module_filter_fn=eligible)
    log.info("train.fp8 = %s: %d linear layers in float8%s", recipe, len(names),
             " (emulated on the CPU)" if device.type != "cuda" else "")
    return names
