"""A quantized frozen base read once per node, not once per rank.

The quantized layers of a frozen base are whole on every rank (FSDP leaves them out: ``ignored_params``), so each
rank used to read every one of them from storage and quantize it: at FLUX about 24 GB a rank, 1.5 TB from shared
storage per restart of a 64-node job. Here the node's ranks split the layers (``owners``: by size, the same on every
rank), each reads and quantizes its own, and each layer's quantized tensors are broadcast from its owner over the
node's process group (NVLink on a GPU node; gloo between CPU processes). The bytes a node reads are the base once.

A node is ``LOCAL_WORLD_SIZE`` consecutive ranks (torchrun numbers a node's ranks consecutively); a world that is not
whole nodes, or a node of one rank, reads as before. The quantized tensors travel as their inner tensors
(``__tensor_flatten__``: data and scales), rebuilt on the receivers by ``__tensor_unflatten__``; a layer its owner
kept in full precision (an fp8 layer with a row of zeros) travels as its weight.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

_GROUPS: dict[tuple[int, int], object] = {}


def node_layout() -> tuple[int, int, object] | None:
    """(local rank, ranks a node, the node's process group) when the world is whole nodes of more than one rank, else
    None. Every rank must call it (creating the groups is a collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local <= 1 or world % local or local > world:
        return None
    key = (world, local)
    if key not in _GROUPS:
        group, _ = dist.new_subgroups(group_size=local)
        _GROUPS[key] = group
    return rank % local, local, _GROUPS[key]


def owners(layers: dict[str, nn.Linear], ranks: int) -> dict[str, int]:
    """Each layer's owner among a node's ``ranks``: the largest first, each to the least loaded rank (ties to the
    lowest), in name order for equal sizes, so every rank computes the same."""
    load = [0] * ranks
    out = {}
    for name in sorted(layers, key=lambda n: (-layers[n].weight.numel(), n)):
        r = min(range(ranks), key=lambda i: (load[i], i))
        out[name] = r
        load[r] += layers[name].weight.numel()
    return out


def share(layers: dict[str, nn.Linear], owner: dict[str, int], local_rank: int, ranks: int, group, device,
          adopt) -> int:
    """Broadcast every layer from its owner to the node's other ranks, in name order; ``adopt(layer, weight)`` puts a
    received weight in place. Returns the bytes this rank received."""
    base = dist.get_rank() - local_rank             # the node's first global rank
    received = 0
    for name in sorted(layers):
        layer, src = layers[name], base + owner[name]
        mine = owner[name] == local_rank
        meta, payload = [None], []
        if mine:             # whatever fails here is said to the node's ranks, which would otherwise wait forever
            try:
                meta[0] = _describe(layer.weight)
                parts = [getattr(layer.weight, n) for n in meta[0][1]] if meta[0][0] is not None else [layer.weight]
                payload = [_as_bytes(t.detach()) for t in parts]
            except Exception as e:  # noqa: BLE001 -- sent on, then raised here
                meta[0] = ("error", f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(meta, src=src, group=group)
        if meta[0][0] == "error":
            raise RuntimeError(f"node_share: local rank {owner[name]} could not send {name} ({meta[0][1]})")
        kind, names, ctx, size, stride, specs = meta[0]
        if mine:
            for buf in payload:
                dist.broadcast(buf, src=src, group=group)
            continue
        tensors = []
        for shape, tstride, dtype in specs:
            t = torch.empty_strided(shape, tstride, dtype=dtype, device=device)
            buf = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device=device)
            dist.broadcast(buf, src=src, group=group)
            t.copy_(buf.view(dtype).reshape(shape))
            tensors.append(t)
            received += buf.numel()
        weight = tensors[0] if kind is None else \
            kind.__tensor_unflatten__(dict(zip(names, tensors)), ctx, torch.Size(size), stride)
        adopt(layer, weight)
    return received


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as one flat uint8 tensor, in row-major order (a view where the layout allows, else a copy): gloo
    has no float8 (nor every dtype a quantized weight's parts come in), every backend has bytes."""
    flat = t.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:          # a size-1 dimension with a stride of its own (NF4's factor)
        flat = torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)
    return flat.view(torch.uint8)


def _describe(w: torch.Tensor):
    """(subclass or None, inner tensor names, flatten context, size, stride, [(shape, stride, dtype)]) of a weight."""
    flatten = getattr(type(w), "__tensor_flatten__", None)
    if flatten is None or type(w) in (torch.Tensor, nn.Parameter):
        return None, [], None, tuple(w.shape), tuple(w.stride()), [(tuple(w.shape), tuple(w.stride()), w.dtype)]
    names, ctx = w.__tensor_flatten__()
    inner = [getattr(w, n) for n in names]
    if any(type(t) is not torch.Tensor for t in inner):
        raise TypeError(f"{type(w).__name__}: nested tensor subclasses are not sent whole")
    return type(w), list(names), ctx, tuple(w.shape), tuple(w.stride()), \
        [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in inner]
