"""Attention kernels: a registry of backends with their constraints, and the per-shape dispatch (the hybrid).

Every attention call of the model goes through one function of (q, k, v, key mask) (``models.attention``); which
kernel runs it is chosen here:
- ``sdpa``: PyTorch SDPA with its own choice (the default);
- ``sdpa-math``, ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-cudnn``: SDPA pinned to one kernel (``sdpa_kernel``);
- ``sdpa-fa3``, ``sdpa-fa4``: SDPA's flash kernel with FlashAttention 3 / 4 activated
  (``activate_flash_attention_impl``), where this torch registers them and the GPU runs them;
- ``flex``: FlexAttention, compiled, the key mask as a block mask (no backward on a CPU: inference only there);
- ``flash-attn``: the ``flash-attn`` package (no key mask; fp16/bf16 on CUDA), when installed.
Each backend states what it takes (devices, dtypes, head dims, whether it takes a key mask, where it has a
backward, whether context parallelism may use it); ``check`` says why one cannot run a shape, and
``kernel_for`` builds the callable the model uses: one backend, or a ``HybridKernel`` dispatching each shape to
its tuned winner (``parallel.tune``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from difftrain.errors import UserError

log = logging.getLogger("difftrain")

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Shape:
    """One attention call: (batch, heads, sequence, head dim), dtype, whether a key mask is passed."""
    batch: int
    heads: int
    length: int
    head_dim: int
    dtype: str = "fp32"
    masked: bool = False

    @property
    def key(self) -> str:
        """What the dispatch tells shapes apart by (not the batch: a kernel's ranking hardly moves with it, and a
        store-fed run's micro-batches vary by bucket)."""
        return f"H{self.heads}-L{self.length}-D{self.head_dim}-{self.dtype}{'-mask' if self.masked else ''}"

    @staticmethod
    def of(q: Tensor, mask: Tensor | None) -> "Shape":
        B, H, L, D = q.shape
        return Shape(B, H, L, D, DTYPE_NAMES.get(q.dtype, str(q.dtype)), mask is not None)


@dataclass(frozen=True)
class Backend:
    name: str
    doc: str
    run: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor]
    devices: tuple[str, ...]
    dtypes: tuple[str, ...]
    masks: bool                              # takes a key-padding mask
    backward_on: tuple[str, ...]             # devices where it has a backward
    cp_safe: bool = True                     # may run inside context parallelism's all-to-all attention
    max_head_dim: int = 1 << 30
    head_dim_multiple: int = 1
    min_capability: tuple[int, int] | None = None   # CUDA compute capability
    needs: Callable[[], str | None] = lambda: None  # why it is not available in this install, or None

    def check(self, shape: Shape, device: torch.device, training: bool, cp: int = 1) -> str | None:
        """Why this backend cannot run ``shape`` here, or None."""
        missing = self.needs()
        if missing:
            return missing
        if device.type not in self.devices:
            return f"runs on {', '.join(self.devices)}, not {device.type}"
        if self.min_capability and device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            if cap < self.min_capability:
                return f"needs CUDA compute capability {self.min_capability}, this GPU has {cap}"
        if shape.dtype not in self.dtypes:
            return f"takes {', '.join(self.dtypes)}, not {shape.dtype}"
        if shape.head_dim > self.max_head_dim or shape.head_dim % self.head_dim_multiple:
            return (f"takes head dims up to {self.max_head_dim} in multiples of {self.head_dim_multiple}, not "
                    f"{shape.head_dim}")
        if shape.masked and not self.masks:
            return "takes no key mask (padded text needs one)"
        if training and device.type not in self.backward_on:
            return f"has no backward on {device.type} (inference only there)"
        if cp > 1 and not self.cp_safe:
            return "is not safe under context parallelism"
        return None


# ---- the kernels ----------------------------------------------------------------------------------------------
def sdpa_default(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _pinned(kernel) -> Callable:
    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(kernel):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return run


def _fa_impl(name: str) -> Callable:
    def run(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        import torch.nn.attention as A
        from torch.nn.attention import SDPBackend, sdpa_kernel

        A.activate_flash_attention_impl(name)
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        finally:
            A.restore_flash_attention_impl()
    return run


def _fa_impl_missing(name: str) -> Callable[[], str | None]:
    def needs() -> str | None:
        import torch.nn.attention as A

        lister = getattr(A, "list_flash_attention_impls", None)
        if lister is None:
            return f"this torch ({torch.__version__}) has no activate_flash_attention_impl"
        try:
            impls = lister()
        except Exception as e:  # noqa: BLE001 - the registry may raise without CUDA
            return f"this torch lists no flash attention implementations ({e})"
        return None if name in impls else f"this torch does not register {name} (has {sorted(impls)})"
    return needs


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    block = None
    if mask is not None:
        keys = mask.reshape(mask.shape[0], -1)           # (B, L) True = attend

        def keep(b, h, q_idx, kv_idx):
            return keys[b, kv_idx]
        block = create_block_mask(keep, keys.shape[0], None, q.shape[2], k.shape[2], device=q.device)
    return _compiled_flex()(q, k, v, block_mask=block)


def _flash_attn(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    from flash_attn import flash_attn_func

    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _module_missing(name: str) -> Callable[[], str | None]:
    return lambda: None if importlib.util.find_spec(name) else f"the {name} package is not installed"


def _registry() -> dict[str, Backend]:
    from torch.nn.attention import SDPBackend

    all_dtypes = ("fp32", "bf16", "fp16")
    half = ("bf16", "fp16")
    return {b.name: b for b in (
        Backend("sdpa", "PyTorch SDPA, its own kernel choice", sdpa_default, ("cpu", "cuda"), all_dtypes, True,
                ("cpu", "cuda")),
        Backend("sdpa-math", "SDPA's math kernel (the reference)", _pinned(SDPBackend.MATH), ("cpu", "cuda"),
                all_dtypes, True, ("cpu", "cuda")),
        Backend("sdpa-flash", "SDPA's flash kernel (FlashAttention 2 on CUDA; a flash kernel for the CPU)",
                _pinned(SDPBackend.FLASH_ATTENTION), ("cpu", "cuda"), all_dtypes, True, ("cpu", "cuda"),
                max_head_dim=256),
        Backend("sdpa-efficient", "SDPA's memory-efficient kernel (xFormers-style)",
                _pinned(SDPBackend.EFFICIENT_ATTENTION), ("cuda",), all_dtypes, True, ("cuda",)),
        Backend("sdpa-cudnn", "SDPA's cuDNN fused attention", _pinned(SDPBackend.CUDNN_ATTENTION), ("cuda",), half,
                True, ("cuda",), max_head_dim=256, head_dim_multiple=8, min_capability=(8, 0)),
        Backend("sdpa-fa3", "SDPA's flash kernel with FlashAttention 3 (Hopper)", _fa_impl("FA3"), ("cuda",), half,
                False, ("cuda",), max_head_dim=256, head_dim_multiple=8, min_capability=(9, 0),
                needs=_fa_impl_missing("FA3")),
        Backend("sdpa-fa4", "SDPA's flash kernel with FlashAttention 4 (Blackwell)", _fa_impl("FA4"), ("cuda",),
                half, False, ("cuda",), max_head_dim=256, head_dim_multiple=8, min_capability=(10, 0),
                needs=_fa_impl_missing("FA4")),
        Backend("flex", "FlexAttention, compiled; the key mask as a block mask", flex, ("cpu", "cuda"),
                all_dtypes, True, ("cuda",), head_dim_multiple=1),
        Backend("flash-attn", "the flash-attn package's flash_attn_func", _flash_attn, ("cuda",), half, False,
                ("cuda",), max_head_dim=256, head_dim_multiple=8, min_capability=(8, 0),
                needs=_module_missing("flash_attn")),
    )}


BACKENDS: dict[str, Backend] = _registry()
MATH = "sdpa-math"


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise UserError(f"attention.backend = {name!r}: no such backend; the backends are {sorted(BACKENDS)} "
                        "(or 'auto': each shape's tuned winner)")
    return BACKENDS[name]


def require(name: str, shapes: list[Shape], device: torch.device, training: bool, cp: int = 1) -> Backend:
    """The backend ``name``, checked against every shape the run will meet; a clear error otherwise."""
    b = backend(name)
    for s in shapes:
        why = b.check(s, device, training, cp)
        if why:
            ok = [n for n, o in BACKENDS.items() if o.check(s, device, training, cp) is None]
            raise UserError(f"attention.backend = {name!r} {why} (shape {s.key}{', training' if training else ''}); "
                            f"backends that can: {ok}")
    return b


class HybridKernel:
    """Each shape to its backend (the tuned table); a shape not in the table runs ``fallback``. ``calls`` counts
    calls on a tuned kernel and on the fallback where the model runs eagerly (under torch.compile the dispatch is
    traced once per shape, and the trainer counts from its batches' shapes: ``tune.dispatch_counts``)."""

    def __init__(self, table: dict[str, str], fallback: str = "sdpa"):
        self.table = dict(table)
        self.fallback = fallback
        self.runs = {k: BACKENDS[v].run for k, v in self.table.items()}
        self.default = BACKENDS[fallback].run
        self.unknown: set[str] = set()
        self.calls = {"tuned": 0, "fallback": 0}

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        key = Shape.of(q, mask).key
        run = self.runs.get(key)
        eager = not torch.compiler.is_compiling()
        if run is None:
            if eager:
                self.calls["fallback"] += 1
                if key not in self.unknown:
                    self.unknown.add(key)
                    log.debug("attention: shape %s was not tuned; %s runs it", key, self.fallback)
            run = self.default
        elif eager:
            self.calls["tuned"] += 1
        return run(q, k, v, mask)
