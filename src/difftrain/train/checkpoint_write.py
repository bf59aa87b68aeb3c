"""How a checkpoint's tensors reach storage: which of them this rank writes (``save_share``: a tensor several ranks
hold alike is written, and staged, by one of them), the host-memory staging of an async save (``_ReusedStager``),
the copy of device tensors to the host in bounded pieces (``host_pieces``) and the streaming safetensors writer DCP
drives (``StreamingSafetensorsWriter``: checksummed as written). ``checkpoint.Checkpointer`` uses them."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from difftrain.train.verification import CHUNK as _CHUNK, Digest, write_sidecar


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class StreamingSafetensorsWriter(HuggingFaceStorageWriter):
    """DCP's safetensors writer, writing each file as a stream: the header, then every tensor's bytes straight
    from its memory (``safetensors.torch.save`` builds the whole file as one bytes object first, two extra
    copies made while holding the GIL, which an async save's training thread then waits on). The file is
    checksummed in pieces as it is written; the size and CRC-32s go to ``NAME.digest`` beside it, so that sealing the
    checkpoint need not read the shards back. Same format, same headers: DCP's reader loads it."""

    written: list[str] | None = None
    bytes_written = 0           # this rank's tensor bytes, written by write_data

    def finish(self, metadata, results):
        """DCP's coordinator (rank 0) gets every rank's write results: the files of the checkpoint, which the seal
        lists rather than what a directory listing shows."""
        self.written = sorted({wr.storage_data.relative_path for rank in results for wr in rank})
        return super().finish(metadata, results)

    def write_data(self, plan, planner):
        from torch.distributed.checkpoint._hf_utils import (CUSTOM_METADATA_KEY, DCP_VERSION_KEY, FORMAT_KEY,
                                                             FORMAT_VALUE, HF_DCP_VERSION, _gen_file_name)
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.storage import WriteResult
        from torch.futures import Future

        fut: Future = Future()
        try:
            storage = plan.storage_data or {}
            mapping = storage.get("fqn_to_index_mapping")
            buckets = self._split_by_storage_plan(mapping, plan.items)
            highest = max(mapping.values()) if mapping is not None else 1
            results = []
            for index, items in buckets.items():
                name = _gen_file_name(index, highest, storage.get("shard_index"))
                results += self._write_file(Path(self.path) / name, name, items, planner, _StorageInfo, WriteResult,
                                            {CUSTOM_METADATA_KEY: None, DCP_VERSION_KEY: str(HF_DCP_VERSION),
                                             FORMAT_KEY: FORMAT_VALUE})
            self.bytes_written = sum(r.size_in_bytes for r in results)
            fut.set_result(results)
        except Exception as e:     # noqa: BLE001 - reported through the future, as DCP's writers do
            fut.set_exception(e)
        return fut

    @staticmethod
    def _write_file(path: Path, name: str, items, planner, storage_info, write_result, meta: dict) -> list:
        import struct

        names = {v: k for k, v in _DTYPES.items()}
        tensors, header, sharding, offset = [], {}, {}, 0
        for wi in items:
            t = planner.resolve_data(wi)
            if not isinstance(t, Tensor):
                raise TypeError(f"{wi.index.fqn}: only tensors are written to safetensors shards")
            t = t.detach().contiguous()
            n = t.numel() * t.element_size()
            fqn = wi.index.fqn
            header[fqn] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            sharding[fqn] = {"saved_offsets": list(wi.tensor_data.chunk.offsets)}
            tensors.append((wi, t, offset, n))
            offset += n
        meta = dict(meta)
        key = next(k for k, v in meta.items() if v is None)
        meta[key] = json.dumps(sharding)
        head = json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)                  # the data starts 8-byte aligned
        digest = Digest()
        out = []
        with path.open("wb") as f:
            for chunk in (struct.pack("<Q", len(head)), head):
                f.write(chunk)
                digest.update(chunk)
            start = 8 + len(head)
            for wi, t, off, n in tensors:
                for piece in host_pieces(t, _CHUNK):    # crc32 and write release the GIL on large buffers
                    digest.update(piece)
                    f.write(piece)
                out.append(write_result(index=wi.index, size_in_bytes=n,
                                        storage_data=storage_info(name, start + off, n)))
            f.flush()
            os.fsync(f.fileno())
        write_sidecar(path, digest.result())
        return out


def save_share(state: dict[str, Any], rank: int | None = None, world: int | None = None) -> dict[str, Any]:
    """The entries of a state dict that this rank writes: a tensor that several ranks hold identically (a DTensor
    replicated over a mesh dimension, as HSDP's replica groups hold each shard; a plain tensor, held by every
    rank) is written by one of them, so only that one stages it (DCP would write it once anyway, after every
    replica had copied it to host memory). Owners are chosen greedily by bytes over the sorted keys, from
    global shapes only, so every rank computes the same assignment with no communication, and writing is spread
    over the replicas rather than left to the first one.

    Not distributed (``world`` 1): the whole state."""
    from torch.distributed.tensor import DTensor

    if world is None:
        world = dist.get_world_size() if _distributed() else 1
        rank = dist.get_rank() if _distributed() else 0
    if world == 1:
        return dict(state)
    loads: dict[int, list[int]] = {}
    out = {}
    for key in sorted(state):
        v = state[key]
        if isinstance(v, DTensor):
            mesh, placements = v.device_mesh, v.placements
            dims = [i for i, pl in enumerate(placements) if pl.is_replicate()]
            copies = math.prod(mesh.size(i) for i in dims)
            coord = mesh.get_coordinate() or [0] * mesh.ndim
            mine = 0
            for i in dims:
                mine = mine * mesh.size(i) + coord[i]
            size = v.numel() * v.element_size() * copies // max(1, mesh.size())   # one shard's bytes
        elif isinstance(v, Tensor):
            copies, mine, size = world, rank, v.numel() * v.element_size()
        else:
            out[key] = v
            continue
        if copies == 1:
            out[key] = v
            continue
        load = loads.setdefault(copies, [0] * copies)
        owner = min(range(copies), key=lambda i: (load[i], i))
        load[owner] += max(size, 1)
        if owner == mine:
            out[key] = v
    return out


def tensor_bytes(state: dict[str, Any]) -> int:
    """Bytes of a state dict's local tensors (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    return sum((v.to_local() if isinstance(v, DTensor) else v).numel() * v.element_size()
               for v in state.values() if isinstance(v, Tensor))


def host_pieces(t: Tensor, chunk: int):
    """``t``'s bytes as host buffers of at most ``chunk`` bytes, in order. A host tensor gives views of its own
    memory; a device tensor (a blocking save writes the live GPU shards: no stager copied them) is copied over one
    piece at a time through one reused buffer (pinned where CUDA is), so a shard never needs a second full copy
    in host memory. Each piece is on the host before it is yielded (a synchronous copy), and is overwritten by
    the next: the caller uses it before asking for another."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if not n:
        return
    if flat.device.type == "cpu":
        view = memoryview(flat.numpy())
        for i in range(0, n, chunk):
            yield view[i:i + chunk]
        return
    host = torch.empty(min(chunk, n), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        host[:m].copy_(flat[i:i + m])
        yield memoryview(host[:m].numpy())


class _ReusedStager:
    """Host-memory staging buffers allocated at the first save and reused by every later one (pinned when the
    state is on a GPU, so the copy is a fast DMA): a new 1 GB buffer per save costs page faults that show up
    as training stall. Saves never overlap (``save`` waits for the previous one), so one set is enough.

    Host tensors are copied with numpy, not torch: a torch op run from this background thread starts an
    OpenMP thread team of its own, whose idle workers then contend with the training threads' team (seen as
    ~15,000 voluntary context switches a second and 20% slower steps for the rest of the run)."""

    def __init__(self):
        self.cache: dict[str, Tensor] | None = None
        self.keys = None
        self.staged_bytes = 0       # held in host buffers by the last stage()

    def stage(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        from torch.distributed.tensor import DTensor

        local = {k: (v.to_local() if isinstance(v, DTensor) else v).detach() for k, v in state.items()}
        keys = {k: (tuple(v.shape), v.dtype) for k, v in local.items()}
        if self.cache is None or keys != self.keys:
            pin = torch.cuda.is_available() and any(v.is_cuda for v in local.values())
            self.cache = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in local.items()}
            self.keys = keys
            self.staged_bytes = sum(b.numel() * b.element_size() for b in self.cache.values())
        out = {}
        for k, v in state.items():
            buf, src = self.cache[k], local[k]
            if src.is_cuda:
                buf.copy_(src)
            elif src.numel():
                np.copyto(buf.reshape(-1).view(torch.uint8).numpy(), src.contiguous().reshape(-1).view(torch.uint8).numpy())
            out[k] = (DTensor.from_local(buf, v.device_mesh, v.placements, run_check=False, shape=v.shape,
                                         stride=v.stride()) if isinstance(v, DTensor) else buf)
        return out


_DTYPES = {"F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I8": torch.int8, "U8": torch.uint8,
           "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BF16": torch.bfloat16, "BOOL": torch.bool}
