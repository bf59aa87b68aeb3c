"""How a single-device model is spread over devices and sped up: compile now; FSDP2/HSDP, activation
checkpointing, attention backends and the memory planner build on the same entry point."""

from difftrain.parallel.compile import compile_blocks

__all__ = ["compile_blocks"]
