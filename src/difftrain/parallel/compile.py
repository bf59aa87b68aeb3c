"""torch.compile per transformer block (as torchtitan): each block compiles once and the compiled code is
reused by every block of the same shape; ``Module.compile`` compiles in place, so parameter names
(and with them checkpoints and the FLUX adapter) are unchanged.

Compiled artefacts go to a persistent cache directory (by default in the run directory), so a restarted
job reloads them instead of compiling again. Shapes are static: each distinct token-sequence shape of
the bucket plan compiles once (the recompile limit is raised so no shape silently falls back to eager),
and ``compile_count`` lets the trainer log every recompilation.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("difftrain.parallel")
RECOMPILE_LIMIT = 64   # distinct shapes per block before dynamo gives up and runs eager


def use_compile_cache(directory: str | Path) -> Path:
    """Point inductor's FX-graph and AOTAutograd caches at ``directory`` (call before the first compile)."""
    path = Path(directory).resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    return path


def compile_blocks(dit: nn.Module) -> int:
    """Compile every double- and single-stream block of ``dit``; returns how many were compiled."""
    dyn = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):       # renamed across torch releases
        if hasattr(dyn, name):
            setattr(dyn, name, max(getattr(dyn, name), RECOMPILE_LIMIT))
    n = 0
    for blocks in (dit.double_blocks, dit.single_blocks):
        for block in blocks:
            block.compile(dynamic=False)
            n += 1
    return n


def compile_count() -> int:
    """Graphs compiled so far in this process (first compilations and recompilations)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
