"""LoRA adapters on the DiT (peft), for DPO with the policy's own frozen weights as the reference.

``apply_lora`` wraps the DiT's target linear layers in peft LoRA layers (the base weight frozen, ``lora_A``
and ``lora_B`` trainable, scale alpha / rank); their parameter names gain ``.base_layer.`` and
``.lora_A.default.`` / ``.lora_B.default.``. ``base_name`` maps a name back to the plain model's (what
checkpoints of the model and exports hold). ``adapters_disabled`` runs the DiT as it was before the adapters:
the reference. ``merged`` gives a target layer's weight with its adapter folded in, for an export that is a
plain model.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from difftrain.errors import UserError

ADAPTER = "default"


def apply_lora(dit: nn.Module, rank: int, alpha: float, targets: list[str]) -> list[str]:
    """Inject LoRA into the linear layers whose names end with one of ``targets`` (in place; works on the meta
    device). Returns the adapted layers' names; none matched is an error naming the targets."""
    from peft import LoraConfig, inject_adapter_in_model

    names = [n for n, m in dit.named_modules() if isinstance(m, nn.Linear) and any(
        n == t or n.endswith("." + t) for t in targets)]
    if not names:
        raise UserError(f"dpo.lora_targets = {targets}: no linear layer of the DiT has a name ending with one of "
                        "them (e.g. 'qkv', 'proj', 'linear1', 'linear2', 'img_mlp.0')")
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=names, lora_dropout=0.0,
                                       init_lora_weights=True), dit, adapter_name=ADAPTER)
    return names


def is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """A parameter's name in the plain model (``x.qkv.base_layer.weight`` -> ``x.qkv.weight``)."""
    return name.replace(".base_layer.", ".")


def lora_layers(module: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in module.named_modules() if isinstance(m, LoraLayer)}


@contextmanager
def adapters_disabled(module: nn.Module):
    """Run ``module`` without its adapters (the base weights alone), restoring them afterwards."""
    layers = list(lora_layers(module).values())
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def zero_lora_b(dit: nn.Module, write) -> None:
    """Set every ``lora_B`` to zero (``write(param, value)``, which handles sharded parameters): the adapted model
    then computes exactly what the base computes."""
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if ".lora_B." in name:
                write(p, torch.zeros(p.shape, dtype=p.dtype, device=p.device if p.device.type != "meta" else "cpu"))


def merged(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scale: float) -> Tensor:
    """A target layer's weight with its adapter folded in: W + scale * B @ A (full tensors)."""
    return weight.float() + scale * (lora_b.float() @ lora_a.float())
