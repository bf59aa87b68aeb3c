"""FSDP2 (``fully_shard``) over the data-parallel part of the device mesh.

Wrapping order, as torchtitan's FLUX recipe: every double- and single-stream block is its own FSDP
unit (its parameters are all-gathered just before it runs and freed after), then the DiT root (the
embedders, the final layer), then a trainable text encoder. The ``ModuleDict`` holding them has no
forward of its own, so it is never a unit.

- ``dp_shard > 1``: ZeRO-3 full sharding over ``dp_shard x cp`` (context-parallel ranks hold
  different tokens of the same samples, so they share the gradient reduction and the shards);
- ``dp_replicate > 1`` on top: HSDP, a 2-D mesh (replicate across, shard within);
- ``dp_shard = 1``: the replicate dimension alone, i.e. DDP arithmetic through the same code path.

Gradients are *summed* across ranks (divide factor 1): the loss of every rank is already divided by
the global number of loss tokens, so a mean here would divide twice.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def mixed_precision(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """bf16 compute copies of the parameters with fp32 gradient reduction (GPUs); fp32 throughout on CPUs."""
    if param_dtype is None or param_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units, innermost first (the order ``apply_fsdp`` wraps them in)."""
    dit = model["dit"] if isinstance(model, nn.ModuleDict) else model
    units = [*dit.double_blocks, *dit.single_blocks, dit]
    if isinstance(model, nn.ModuleDict) and "text" in model:
        units.append(model["text"])
    return units


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               cpu_offload: bool = False, reshard_after_forward: bool = True) -> list[FSDPModule]:
    """Shard ``model`` (an ``MMDiT`` or ``{"dit", "text"?}`` ModuleDict) in place over ``mesh`` (1-D: FSDP;
    2-D (replicate, shard): HSDP). Returns the FSDP units, innermost first."""
    kwargs = {"mesh": mesh, "mp_policy": mixed_precision(param_dtype),
              "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    units = fsdp_units(model)
    dit = model["dit"] if isinstance(model, nn.ModuleDict) else model
    blocks = {id(b) for b in (*dit.double_blocks, *dit.single_blocks)}
    for unit in units:
        # Roots (the DiT's embedders and head, the text encoder) are needed again at the start of backward:
        # keep them gathered; blocks are freed after their forward (ZeRO-3).
        fully_shard(unit, reshard_after_forward=reshard_after_forward and id(unit) in blocks, **kwargs)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        # Plain SUM collectives: gloo has no PREMUL_SUM, and NCCL is zero-copy only for sum-type reductions.
        unit.set_force_sum_reduction_for_comms(True)
    return units  # type: ignore[return-value]


def set_gradient_sync(units: list[FSDPModule], enabled: bool) -> None:
    """Gradient accumulation: skip the reduce-scatter on all micro-batches but the last."""
    for unit in units:
        unit.set_requires_gradient_sync(enabled, recurse=False)


def write_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write a parameter's full value into it; a sharded (DTensor) parameter keeps only its own part, cut
    locally with no communication (every rank computed the same full value)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        part = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(part.to_local())
    else:
        param.copy_(value)
