"""A safetensors file written tensor by tensor (``difftrain export`` and the end-of-run export): the header
first, then each tensor's bytes as it comes, so no more than one tensor (or one group) is ever held."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from difftrain.errors import UserError

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
              torch.float8_e8m0fnu: "F8_E8M0"}


class SafetensorsStreamWriter:
    """A safetensors file written tensor by tensor: the header (all names, shapes, dtypes) first, then the data
    in header order, so no more than one group of tensors is ever held."""

    def __init__(self, path: Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]], metadata: dict[str, str]):
        self.path, self.entries = path, entries
        header: dict[str, Any] = {"__metadata__": metadata}
        at = 0
        for name, shape, dtype in entries:
            if dtype not in ST_DTYPES:
                raise UserError(f"{name}: dtype {dtype} cannot be written to safetensors here")
            n = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
            at += n
        self.data_bytes = at
        raw = json.dumps(header, separators=(",", ":")).encode()
        self.header = raw + b" " * (-len(raw) % 8)          # data starts 8-byte aligned
        self.next = 0

    def __enter__(self) -> "SafetensorsStreamWriter":
        self.file = open(self.path, "wb")
        self.file.write(struct.pack("<Q", len(self.header)) + self.header)
        return self

    def write(self, name: str, t: Tensor) -> None:
        want, shape, dtype = self.entries[self.next]
        if name != want or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise RuntimeError(f"export: wrote {name} {tuple(t.shape)} {t.dtype}, expected {want} {shape} {dtype}")
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))
        self.next += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                if self.next != len(self.entries):
                    raise RuntimeError(f"export: {len(self.entries) - self.next} tensors of {self.path} not written")
                expected = 8 + len(self.header) + self.data_bytes
                if self.file.tell() != expected:
                    raise RuntimeError(f"export: {self.path} is {self.file.tell()} bytes, expected {expected}")
                self.file.flush()
                os.fsync(self.file.fileno())
        finally:
            self.file.close()
