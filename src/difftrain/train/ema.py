"""Exponential moving average of the trainable weights, kept in float32 whatever the training dtype.

The decay warms up as min(decay, (1 + n) / (10 + n)) so a short run's EMA is not dominated by its
random initialisation. ``applied(model)`` swaps the EMA weights in for sampling and evaluation.
Under FSDP the parameters are sharded DTensors and so is the EMA: each rank keeps (and checkpoints)
only the shadow of its own shard, updated with local arithmetic.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _reshard(model: nn.Module) -> None:
    """Put every FSDP unit back in its sharded state, so ``named_parameters`` yields the shards."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class EMA:
    """Tracks the parameter objects it is built with. Under FSDP those are the sharded parameters (the
    optimizer's); a module's ``named_parameters`` may name the gathered copies while a unit is unsharded."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.updates = 0
        self.params: dict[str, nn.Parameter] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.shadow: dict[str, Tensor] = {n: p.detach().float().clone() for n, p in self.params.items()}

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        d = self.current_decay()
        shadows = [_local(self.shadow[n]) for n in self.params]
        torch._foreach_lerp_(shadows, [_local(p.detach()).float() for p in self.params.values()], 1.0 - d)
        self.updates += 1

    @contextlib.contextmanager
    def applied(self, model: nn.Module):
        """Temporarily load the EMA weights into ``model`` (restored on exit, even on error)."""
        _reshard(model)
        backup = {}
        with torch.no_grad():
            for name, p in self.params.items():
                backup[name] = _local(p.detach()).clone()
                _local(p.detach()).copy_(_local(self.shadow[name]))
        try:
            yield model
        finally:
            _reshard(model)   # a forward in eval leaves FSDP roots gathered: back to the shards first
            with torch.no_grad():
                for name, p in self.params.items():
                    _local(p.detach()).copy_(backup[name])

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        missing = self.shadow.keys() - state.keys()
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}...")
        for k in self.shadow:
            if state[k] is not self.shadow[k]:      # a checkpoint load fills the shadows in place
                _local(self.shadow[k]).copy_(_local(state[k]))
