"""Reading a checkpoint's safetensors files with plain reads instead of a memory map.

``HuggingFaceStorageReader`` opens each file with ``safe_open``, which maps it: every page a load touches
counts in the process's resident memory until the file is closed, so loading a model into its own parameters
peaks at about twice the weights' bytes of RSS (the parameters, plus the file's mapped pages), and a rank of
a sharded model maps the pages of the rows it reads. ``PlainReader`` keeps DCP's planning (metadata, resharding,
the checks) and reads each request's rows with ``readinto``: straight into the destination tensor when it is a
contiguous CPU tensor of the stored dtype (a parameter, or a rank's shard of one), else into a buffer of the
request's size, copied into the destination (cast to its dtype) and freed. The process holds the parameters
and at most one request's buffer.

The safetensors layout: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape
and ``data_offsets`` (from the end of the header), then the tensors' bytes, row-major.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.futures import Future

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsFile:
    """One safetensors file, read by rows: ``read(name, slices)`` reads the rows ``slices[0]`` selects (one
    contiguous range) and returns the tensor with the remaining slices applied."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.f = open(self.path, "rb", buffering=0)
        try:
            head = self.f.read(8)
            if len(head) != 8:
                raise ValueError(f"{self.path}: not a safetensors file ({len(head)} bytes)")
            (n,) = struct.unpack("<Q", head)
            raw = self.f.read(n)
            if len(raw) != n:
                raise ValueError(f"{self.path}: header of {n} bytes, the file holds {len(raw)} after its length")
            self.header = json.loads(raw)
            self.base = 8 + n
        except BaseException:
            self.f.close()
            raise

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def read(self, name: str, slices: tuple[slice, ...] = (), out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor ``name`` cut by ``slices``. With ``out`` (a contiguous CPU tensor of the stored dtype and
        the result's shape) and whole rows, the bytes are read straight into ``out``, with no buffer."""
        meta = self.header.get(name)
        if meta is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        if meta["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {meta['dtype']!r}, not one of {sorted(DTYPES)}")
        dtype, shape = DTYPES[meta["dtype"]], list(meta["shape"])
        begin, end = meta["data_offsets"]
        size = torch.empty((), dtype=dtype).element_size()
        if end - begin != size * math.prod(shape):
            raise ValueError(f"{self.path}: tensor {name!r} spans {end - begin} bytes, its shape {shape} needs "
                             f"{size * math.prod(shape)}")
        if not shape:
            return self._bytes(begin, end - begin, name).view(dtype).reshape(())
        rows = slices[0] if slices else slice(0, shape[0])
        start, stop = rows.start or 0, shape[0] if rows.stop is None else rows.stop
        row = size * math.prod(shape[1:])
        whole_rows = all((sl.start or 0) == 0 and (sl.stop is None or sl.stop == n) for sl, n in
                         zip(slices[1:], shape[1:]))
        if (out is not None and whole_rows and out.dtype == dtype and out.device.type == "cpu"
                and out.is_contiguous() and list(out.shape) == [stop - start, *shape[1:]]):
            self._bytes(begin + start * row, (stop - start) * row, name, out.view(-1).view(torch.uint8))
            return out
        t = self._bytes(begin + start * row, (stop - start) * row, name).view(dtype).reshape(stop - start, *shape[1:])
        return t[(slice(None), *slices[1:])] if len(slices) > 1 else t

    def _bytes(self, offset: int, n: int, name: str, buf: torch.Tensor | None = None) -> torch.Tensor:
        buf = torch.empty(n, dtype=torch.uint8) if buf is None else buf
        view, got = memoryview(buf.numpy()), 0
        self.f.seek(self.base + offset)
        while got < n:
            k = self.f.readinto(view[got:])
            if not k:
                raise ValueError(f"{self.path}: tensor {name!r} ends past the end of the file (truncated: "
                                 f"{n - got} of its bytes missing)")
            got += k
        return buf


class PlainReader(HuggingFaceStorageReader):
    """``HuggingFaceStorageReader`` with plain reads (see the module docstring); one file at a time."""

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for file_name, reqs in per_file.items():
            with SafetensorsFile(file_name) as f:
                for req in reqs:
                    slices = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))
                    target = planner.resolve_tensor(req).detach()
                    tensor = f.read(req.storage_index.fqn, slices, out=target)
                    if target.size() != tensor.size():
                        raise ValueError(f"{file_name}: {req.storage_index.fqn} read as {tuple(tensor.size())}, "
                                         f"the destination is {tuple(target.size())}")
                    if tensor is not target:
                        target.copy_(tensor)
                    planner.commit_tensor(req, target)
                    del tensor
        fut: Future = Future()
        fut.set_result(None)
        return fut
