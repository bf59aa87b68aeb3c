"""Adapters on the DiT (peft LoRA and LoKr): fine-tuning on any objective, and DPO's reference.

``apply_adapter`` wraps the DiT's target linear layers in peft adapter layers (the base weight frozen, the
adapter's factors trainable); their parameter names gain ``.base_layer.`` and ``.lora_A.default.`` /
``.lora_B.default.`` (LoRA) or ``.lokr_w1.default`` / ``.lokr_w2.default`` (LoKr, the factors of a Kronecker
product; ``_a``/``_b`` halves where a factor is itself low-rank). ``base_name`` maps a name back to the plain
model's (what checkpoints of the base model and exports hold). ``adapters_disabled`` runs the DiT as it was before
the adapters: DPO's reference. ``delta`` gives a target layer's full update (scale included), for merging, exports
and folding at sampling time. Initial values come from a generator seeded by (seed, parameter name), drawn at the full shape, so an
adapted model starts the same on any world size; the factor peft zeroes (LoRA's B, LoKr's first) starts at zero,
so the adapted model computes exactly what its base computes.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from difftrain.errors import UserError

ADAPTER = "default"
KINDS = ("lora", "lokr")
_MARKERS = (".lora_A.", ".lora_B.", ".lokr_w1", ".lokr_w2", ".lokr_t2")


@dataclass(frozen=True)
class AdapterSpec:
    """What one adapter is: its kind, rank, alpha (scale alpha / rank), target layers by name suffix, dropout."""
    kind: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0
    key: str = "adapter"        # the config section named in errors
    export: str = "adapter"     # the end-of-run export: 'adapter' or 'merge'

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @staticmethod
    def of(cfg, dpo: bool = False) -> AdapterSpec | None:
        """The run's adapter: ``[adapter]`` when its kind is not 'none'; else, for a DPO run (``dpo``), its LoRA
        reference (``dpo.reference = 'lora'``, the ``dpo.lora_*`` keys); else None (every weight trained)."""
        a = cfg.adapter
        if a.kind != "none":
            return AdapterSpec(a.kind, a.rank, a.alpha, tuple(a.targets), a.dropout, "adapter", a.export)
        d = cfg.dpo
        if dpo and d.reference == "lora":
            return AdapterSpec("lora", d.lora_rank, d.lora_alpha, tuple(d.lora_targets), 0.0, "dpo", d.lora_export)
        return None

    def describe(self) -> dict:
        return {"kind": self.kind, "rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "dropout": self.dropout}


def target_layers(dit: nn.Module, targets, key: str = "adapter") -> list[str]:
    """The names of the linear layers ``targets`` select (a name, or a name suffix); none is an error naming the
    key."""
    names = [n for n, m in dit.named_modules() if isinstance(m, nn.Linear) and ".lora_" not in n and any(
        n == t or n.endswith("." + t) for t in targets)]
    if not names:
        which = "dpo.lora_targets" if key == "dpo" else f"{key}.targets"
        raise UserError(f"{which} = {list(targets)}: no linear layer of the DiT has a name ending with one of "
                        "them (e.g. 'qkv', 'proj', 'linear1', 'linear2', 'img_mlp.0')")
    return names


def apply_adapter(dit: nn.Module, spec: AdapterSpec) -> list[str]:
    """Inject ``spec``'s adapter into the DiT's target layers (in place; works on the meta device) and freeze
    everything else of the DiT. Returns the adapted layers' names."""
    from peft import LoKrConfig, LoraConfig, inject_adapter_in_model

    names = target_layers(dit, spec.targets, spec.key)
    if spec.kind == "lora":
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=names, lora_dropout=spec.dropout,
                            init_lora_weights=True)
    elif spec.kind == "lokr":
        config = LoKrConfig(r=spec.rank, alpha=spec.alpha, target_modules=names, module_dropout=spec.dropout,
                            rank_dropout=0.0, init_weights=True)
    else:
        raise UserError(f"{spec.key}.kind = {spec.kind!r}: expected one of {', '.join(KINDS)}")
    inject_adapter_in_model(config, dit, adapter_name=ADAPTER)
    for name, p in dit.named_parameters():
        p.requires_grad_(is_adapter(name))
    return names


def apply_lora(dit: nn.Module, rank: int, alpha: float, targets: list[str]) -> list[str]:
    """DPO's LoRA reference (``dpo.lora_*``): ``apply_adapter`` with a LoRA spec."""
    return apply_adapter(dit, AdapterSpec("lora", rank, alpha, tuple(targets), 0.0, "dpo"))


def is_adapter(name: str) -> bool:
    return any(m in name for m in _MARKERS)


is_lora = is_adapter        # the name DPO's code has used


def base_name(name: str) -> str:
    """A parameter's name in the plain model (``x.qkv.base_layer.weight`` -> ``x.qkv.weight``)."""
    return name.replace(".base_layer.", ".")


def adapter_layers(module: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n: m for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)}



def init_rule(name: str) -> str:
    """How an adapter parameter starts (``DiT.init_weights``' rule names): the factor peft zeroes starts at zero
    (LoRA's B; LoKr's first factor, or its A half), the others uniform as peft's kaiming_uniform(a = sqrt 5)."""
    if ".lora_B." in name or ".lokr_w1.default" in name or ".lokr_w1_a." in name:
        return "zeros"
    return "kaiming"


@contextmanager
def adapters_disabled(module: nn.Module):
    """Run ``module`` without its adapters (the base weights alone), restoring them afterwards."""
    layers = list(adapter_layers(module).values())
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def delta(kind: str, factors: dict[str, Tensor], scale: float, shape: tuple[int, ...]) -> Tensor:
    """A target layer's update from its full factors (keyed 'lora_A', 'lora_B' or 'lokr_w1', 'lokr_w1_a', ...):
    LoRA scale * B @ A; LoKr scale * kron(w1, w2), each factor the product of its halves where it has them."""
    f = {k: v.float() for k, v in factors.items()}
    if kind == "lora":
        return scale * (f["lora_B"] @ f["lora_A"])
    w1 = f["lokr_w1"] if "lokr_w1" in f else f["lokr_w1_a"] @ f["lokr_w1_b"]
    w2 = f["lokr_w2"] if "lokr_w2" in f else f["lokr_w2_a"] @ f["lokr_w2_b"]
    update = scale * torch.kron(w1, w2)
    if tuple(update.shape) != tuple(shape):
        raise ValueError(f"kron of factors {list(w1.shape)} and {list(w2.shape)} is {list(update.shape)}, not {list(shape)}")
    return update


def split_name(name: str) -> tuple[str, str] | None:
    """``x.qkv.lora_A.default.weight`` -> ('x.qkv', 'lora_A'); ``x.qkv.lokr_w1.default`` -> ('x.qkv',
    'lokr_w1'); None for a base parameter."""
    for part in ("lora_A", "lora_B", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_w1", "lokr_w2"):
        tag = f".{part}."
        if tag in name:
            return name.split(tag)[0], part
    return None


def file_digest(paths, cache: dict | None = None) -> str:
    """The identity of a base model's files: sha256 over each file's name, size and content digest. ``cache``
    (``{path: [size, mtime_ns, sha256]}``) spares re-reading a file whose size and mtime are unchanged."""
    from pathlib import Path

    h = hashlib.sha256()
    for p in sorted(Path(x) for x in paths):
        st = p.stat()
        hit = (cache or {}).get(str(p))
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            digest = hit[2]
        else:
            fh = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    fh.update(chunk)
            digest = fh.hexdigest()
            if cache is not None:
                cache[str(p)] = [st.st_size, st.st_mtime_ns, digest]
        h.update(f"{p.name}:{st.st_size}:{digest}\n".encode())
    return h.hexdigest()
