"""FSDP2 (``fully_shard``) over the data-parallel part of the device mesh.

Wrapping order, as torchtitan's FLUX recipe: every double- and single-stream block is its own FSDP
unit (its parameters are all-gathered just before it runs and freed after), then the DiT root (the
embedders, the final layer). A small trainable text encoder (the shapes world's) is not sharded: it is
replicated and its gradients are summed with one all-reduce per step (``all_reduce_grads``). As an FSDP
root of its own it would take token ids, which need no gradient, and some torch releases (2.11) then
never run its post-backward reduction: its shards got no gradient at all.

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
    """bf16 compute copies of the parameters with fp32 gradient reduction (GPUs); fp32 throughout on CPUs.
    Forward inputs are not cast: autocast sets the compute dtype, and the timestep and the RoPE angles
    (computed in float64 on purpose) must reach the blocks in fp32, as they do in a single process."""
    if param_dtype is None or param_dtype == torch.float32:
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def fsdp_units(model: nn.Module, granularity: str = "block") -> list[nn.Module]:
    """The modules that become FSDP units, innermost first (the order ``apply_fsdp`` wraps them in).
    'block': every double- and single-stream block, then the DiT root (training). 'layer': every linear layer
    of the blocks as a unit of its own before its block (sampling: with no backward to overlap, the memory
    gathered at once is the largest linear layer, about a sixth of a double block, not a block and the next)."""
    if granularity not in ("block", "layer"):
        raise ValueError(f"FSDP granularity {granularity!r}: expected 'block' or 'layer'")
    dit = model["dit"] if isinstance(model, nn.ModuleDict) else model
    blocks = [*dit.double_blocks, *dit.single_blocks]
    if granularity == "layer":
        return [*(m for b in blocks for m in [*(x for x in b.modules() if isinstance(x, nn.Linear)), b]), dit]
    return [*blocks, dit]


def replicated_params(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters outside the FSDP units (a jointly trained text encoder): kept whole on every
    rank, their gradients summed by ``all_reduce_grads``."""
    if isinstance(model, nn.ModuleDict) and "text" in model:
        return [p for p in model["text"].parameters() if p.requires_grad]
    return []


def all_reduce_grads(params: list[nn.Parameter]) -> None:
    """Sum the gradients of replicated parameters over all ranks in one flat all-reduce."""
    import torch.distributed as dist

    if not params or not dist.is_initialized():
        return
    for p in params:              # every rank sends the same layout, whatever its graph touched
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               cpu_offload: bool = False, granularity: str = "block", ignored=()) -> list[FSDPModule]:
    """Shard the DiT of ``model`` (an ``MMDiT`` or ``{"dit", "text"?}`` ModuleDict) in place over ``mesh``
    (1-D: FSDP; 2-D (replicate, shard): HSDP). Returns the FSDP units, innermost first (``fsdp_units``).
    ``ignored``: parameters left whole on every rank (a quantized frozen base)."""
    kwargs = {"mesh": mesh, "mp_policy": mixed_precision(param_dtype),
              "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy()}
    if ignored:
        kwargs["ignored_params"] = set(ignored)
    units = fsdp_units(model, granularity)
    for unit in units:
        # The root (the DiT's embedders and head) is needed again at the start of backward: keep it
        # gathered; blocks are freed after their forward (ZeRO-3).
        fully_shard(unit, reshard_after_forward=unit is not units[-1], **kwargs)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        # Plain SUM collectives: gloo has no PREMUL_SUM, and NCCL is zero-copy only for sum-type reductions.
        unit.set_force_sum_reduction_for_comms(True)
    return units  # type: ignore[return-value]


def set_gradient_sync(units: list[FSDPModule], last_micro_batch: bool, mode: str = "last") -> None:
    """Gradient accumulation. 'last': no reduction at all before the last micro-batch (unsharded gradients
    accumulate on every rank); 'every': reduce-scatter each micro-batch, and only the cross-replica
    all-reduce of HSDP waits for the last one."""
    for unit in units:
        if mode == "last":
            unit.set_requires_gradient_sync(last_micro_batch, recurse=False)
        else:
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_requires_all_reduce(last_micro_batch, recurse=False)


def write_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write a parameter's full value into it; a sharded (DTensor) parameter keeps only its own part, cut
    locally with no communication (every rank computed the same full value)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        part = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(part.to_local())
    else:
        param.copy_(value)


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip gradients by their global norm over every rank and return that norm (before clipping) as a 0-dim
    tensor on the gradients' device: reading it is the caller's host sync, not this function's.

    Sharded (DTensor) and plain gradients are normed separately and combined, since torch releases differ
    in whether ``clip_grad_norm_`` accepts a mix; the DTensor part reduces over the shards once (one
    collective), and replicated dimensions (HSDP) are not counted twice."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    squares = []
    if sharded:
        norm = torch.nn.utils.get_total_norm(sharded, 2.0)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    if plain:
        squares.append(torch.nn.utils.get_total_norm(plain, 2.0).float() ** 2)
    if not squares:
        return torch.zeros(())
    total = torch.stack([s.to(squares[0].device) for s in squares]).sum().sqrt()
    if max_norm < float("inf"):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        groups: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            groups.setdefault((local.device, local.dtype), []).append(local)
        for (device, dtype), locals_ in groups.items():     # one call per device and dtype, not one per tensor
            torch._foreach_mul_(locals_, coef.to(device, dtype))
    return total
