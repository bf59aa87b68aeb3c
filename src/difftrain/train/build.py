"""One way to build a model: the factory every entry point calls (training's policy, DPO's reference, ``sample``,
``eval``, ``candidates`` and a run's previews through them).

``build_model`` makes the DiT, with a trained word encoder when the run trains one, in one order whatever asks:

1. on the meta device (shapes only);
2. adapters injected, the base frozen (``[adapter]``, DPO's LoRA reference, or the adapters a checkpoint records);
3. float8 training layers (``train.fp8``; a policy only);
4. the quantized base's layers chosen (``adapter.base_precision`` fp8 / nf4), the rest of a frozen base cast to bf16
   where the run computes in bf16;
5. wrapped: context parallelism, activation checkpointing, compile, FSDP2 (a policy at block granularity; a
   reference or a sampler resharded after each forward);
6. materialised on the device, shard by shard, but for the quantized layers: each stays on the meta device until
   its first rows are read, and is quantized once whole, so a quantized base is never whole in full precision;
7. weights: seeded (per-parameter generators: the same on any mesh), read from a base (``model.init_from``: a
   diffusers FLUX folder or a difftrain export), from a difftrain checkpoint (DPO's start; a run to sample), or a
   base plus a checkpoint's adapters (an adapter run: its checkpoints hold the adapters alone).

No entry point calls ``to_empty``, reads weights or applies adapters itself. What a run resumes beside its weights
(optimizer, EMA, loader) is the checkpointer's (``Checkpointer.load``), read into what this built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from difftrain.config import Config
from difftrain.errors import UserError
from difftrain.models import build_dit, dit_params
from difftrain.models.lora import AdapterSpec, base_name, is_adapter

log = logging.getLogger("difftrain.train")

ROLES = ("policy", "reference", "sampler")


@dataclass(frozen=True)
class Weights:
    """Where a model's weights come from: ``seed`` (initialised from ``run.seed``), ``base`` (a base folder or export:
    ``path``), ``checkpoint`` (a difftrain checkpoint's ``prefix`` tensors: 'model' or 'ema'; ``info``: its metadata,
    for an adapter run's base). ``read``: False when a resume will read every tensor anyway (the seeded values are
    then overwritten; a frozen base is read whatever ``read`` says, a checkpoint does not hold it)."""
    kind: str
    path: str = ""
    prefix: str = "model"
    read: bool = True
    info: dict | None = None

    @staticmethod
    def seed() -> "Weights":
        return Weights("seed")

    @staticmethod
    def base(path: str) -> "Weights":
        return Weights("base", str(path))

    @staticmethod
    def checkpoint(path: str, prefix: str = "model", info: dict | None = None) -> "Weights":
        return Weights("checkpoint", str(path), prefix, info=info)


@dataclass
class Built:
    """A built model and what its builder needs to know of it."""
    model: nn.ModuleDict
    adapter: AdapterSpec | None = None
    adapter_layers: list[str] = field(default_factory=list)
    quantized: dict[str, nn.Linear] = field(default_factory=dict)    # the quantized base's layers by weight name
    fp8_layers: int = 0
    units: list = field(default_factory=list)                         # FSDP units
    replicated: list = field(default_factory=list)                    # replicated trainable parameters
    report: dict = field(default_factory=dict)                        # what was read, from where
    precision: str = "bf16"                                           # the quantized base's (adapter.base_precision)
    skip: frozenset = frozenset()      # quantized layers another rank of the node reads and sends (node_share)


def build_model(cfg: Config, role: str, *, device: torch.device, text_encoder: nn.Module, autoencoder: nn.Module,
                weights: Weights, env=None, amp: torch.dtype | None = None, adapter: AdapterSpec | None = None,
                run_dir: Path | None = None, base_words: list[str] | None = None) -> Built:
    """The model ``role`` needs: 'policy' (trainable, wrapped for ``env`` as ``cfg.parallel`` says), 'reference'
    (frozen, wrapped as the policy is, resharded after each forward) or 'sampler' (frozen; sharded over ``env``'s
    ranks when ``env`` is given, else whole on ``device``). ``text_encoder``: joins the model when it is trained
    (a words encoder), else only its widths are used. ``adapter``: the adapter to inject (a policy's or an adapter
    run's checkpoint's). ``base_words``: a words encoder's base vocabulary carried from ``model.init_from``."""
    if role not in ROLES:
        raise ValueError(f"build_model: role {role!r}: expected one of {ROLES}")
    trainable = role == "policy"
    params = dit_params(cfg, autoencoder.latent_channels * 4, text_encoder.dim, text_encoder.pooled_dim)
    modules = {"dit": build_dit(params, device="meta")}                                       # 1
    if getattr(text_encoder, "trainable", False):
        modules["text"] = text_encoder
    model = nn.ModuleDict(modules)
    dit = model["dit"]
    out = Built(model, adapter)
    if adapter is not None:                                                                   # 2
        from difftrain.train.adapters import adapt
        out.adapter_layers = adapt(cfg, model, adapter)
    elif role == "sampler" and _legacy_dpo_lora(cfg, weights):
        from difftrain.models.lora import apply_lora     # an older LoRA DPO run: adapters and base in its checkpoint
        apply_lora(dit, cfg.dpo.lora_rank, cfg.dpo.lora_alpha, list(cfg.dpo.lora_targets))
    if trainable:                                                                             # 3
        from difftrain.parallel.fp8 import apply_fp8
        out.fp8_layers = apply_fp8(dit, cfg.train.fp8, device)
    if adapter is not None and cfg.adapter.base_precision != "bf16":                          # 4
        from difftrain.models.base_quant import base_layers, check_base_precision
        check_base_precision(cfg.adapter.base_precision, device)
        out.quantized = base_layers(dit, cfg.adapter.base_precision)
        out.precision = cfg.adapter.base_precision
    if trainable and adapter is not None and amp == torch.bfloat16:
        from difftrain.train.adapters import frozen_to_bf16
        frozen_to_bf16(dit, set(out.quantized))          # 2 bytes a frozen weight, not fp32 master copies
    if not trainable:
        model.requires_grad_(False)
        if device.type == "cuda" and (amp == torch.bfloat16 or cfg.train.precision == "bf16"):
            _cast_frozen(model, torch.bfloat16, {f"dit.{n}" for n in out.quantized})   # still on the meta device
    if env is not None:                                                                       # 5
        out.units, out.replicated = _wrap(model, cfg, role, env, amp, out.quantized, run_dir)
    offload = trainable and cfg.parallel.cpu_offload and bool(out.units)
    lazy = bool(out.quantized) and (weights.kind != "seed")
    from difftrain.models.base_quant import to_empty_but                                      # 6
    to_empty_but(dit, out.quantized if lazy else {}, "cpu" if offload else device)
    if out.quantized and device.type == "cpu":
        from difftrain.models.base_quant import mmap_large_allocations
        mmap_large_allocations()        # the base's read-through weights and dequantized pieces, returned
    node = _node_split(out, env, weights, lazy)
    _read_weights(out, cfg, role, weights, device, lazy, base_words)                          # 7
    if node is not None:             # the layers the node's other ranks read, from them
        from difftrain.models.base_quant import adopt_quantized
        from difftrain.parallel.node_share import share
        out.report["node_bytes_received"] = share(out.quantized, *node, device, adopt_quantized)
    if out.quantized and device.type == "cpu":
        from difftrain.models.base_quant import release_freed_memory
        release_freed_memory()          # the full-precision weights the base was read through
    if not trainable:
        model.eval()
    return out


def _node_split(out: Built, env, weights: Weights, lazy: bool):
    """With a quantized base read lazily on a world of whole nodes: each layer's owner among the node's ranks, the
    layers this rank leaves to others (``out.skip``); (owners, local rank, ranks, group) for ``node_share.share``."""
    if not (lazy and out.quantized and env is not None and env.world > 1):
        return None
    from difftrain.parallel.node_share import node_layout, owners

    layout = node_layout()
    if layout is None:
        return None
    local_rank, ranks, group = layout
    owner = owners(out.quantized, ranks)
    out.skip = frozenset(n for n, r in owner.items() if r != local_rank)
    return owner, local_rank, ranks, group


def _legacy_dpo_lora(cfg: Config, weights: Weights) -> bool:
    info = weights.info or {}
    return "dpo" in info and "adapter" not in info and cfg.dpo.reference == "lora"


def _cast_frozen(model: nn.Module, dtype: torch.dtype, quantized: set[str]) -> None:
    """A frozen model's floating parameters in ``dtype`` while still on the meta device (allocated so, never in fp32
    first), but for the layers to quantize (read in their own precision, then quantized) and the adapters of an
    adapter run (kept in fp32, as they were trained). A words encoder's embeddings ride along (the whole model as
    before: ``Module.to`` after loading cost a second copy)."""
    for prefix, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            full = f"{prefix}.{name}" if prefix else name
            if base_name(full) in quantized or is_adapter(full) or not p.is_floating_point() or p.dtype == dtype:
                continue
            setattr(module, name, nn.Parameter(p.detach().to(dtype), requires_grad=False))


def _wrap(model: nn.ModuleDict, cfg: Config, role: str, env, amp, quantized: dict, run_dir: Path | None):
    from difftrain.parallel import parallelize
    from difftrain.parallel.compile import use_compile_cache

    if role == "policy" and cfg.train.compile and cfg.train.compile_cache != "off" and run_dir is not None:
        use_compile_cache(cfg.train.compile_cache or Path(run_dir) / "compile_cache")
    if role == "sampler":
        units, replicated = parallelize(model, sampler_config(cfg, env.world), env, None, granularity="layer")
    else:
        units, replicated = parallelize(model, cfg, env, amp, ignored=[m.weight for m in quantized.values()])
    if role != "policy":
        for unit in units:      # no backward through it: the root need not stay gathered after its forward either
            unit.set_reshard_after_forward(True)
    return units, replicated


def sampler_config(cfg: Config, world: int) -> Config:
    """The run's config for sampling over ``world`` ranks: the model sharded over every rank (no replicas, no context
    parallelism, no compilation), whatever mesh it was trained on."""
    import dataclasses
    par = dataclasses.replace(cfg.parallel, dp_replicate=1, dp_shard=-1, cp=1, ac="none", cpu_offload=False)
    train = dataclasses.replace(cfg.train, compile=False, global_batch=world, micro_batch=0)
    data = dataclasses.replace(cfg.data, source="shapes", stages=[])
    return dataclasses.replace(cfg, parallel=par, train=train, data=data)


def _read_weights(out: Built, cfg: Config, role: str, w: Weights, device, lazy: bool, base_words) -> None:
    """Step 7: the weights into the materialised model (its own parameters, each rank's shards: one copy)."""
    from difftrain.parallel.fsdp import write_param

    model, dit = out.model, out.model["dit"]
    adapted = out.adapter is not None
    if role == "policy":
        # seeded first: everything the reads below do not write (adapters on a read base; all of it otherwise)
        if w.kind == "seed" or not (w.read or adapted):
            only = (lambda n: base_name(n) not in out.quantized) if out.quantized else None
        else:
            only = is_adapter if adapted else (lambda n: False)
        with torch.no_grad():
            dit.init_weights(cfg.model.init, cfg.run.seed, write_param, only=only)
        if w.kind == "seed" or not (w.read or adapted):
            return
        if w.kind == "base":
            out.report = _read_base(out, w.path, device, lazy)
            log.info("initialised from %s (%s)", w.path, out.report)
            if base_words is not None and "text" in model and w.read:
                from difftrain.parallel.words_init import load_word_encoder
                words = load_word_encoder(model["text"], w.path, base_words)
                log.info("word encoder from %s: %s", w.path, words)
        else:
            _read_checkpoint(out, w.path, w.prefix, device, lazy, frozen_only=adapted)
        return
    if role == "reference":
        _read_checkpoint(out, w.path, w.prefix, device, lazy)
        return
    # a sampler: a checkpoint's weights (an adapter run's: its base from where the run read it, then its adapters)
    from difftrain.train.checkpoint import Checkpointer
    params = {k: v.detach() for k, v in model.named_parameters()}
    if adapted:
        params = _read_adapter_base(out, cfg, w.info, device, lazy)
    Checkpointer.load_tensors(w.path, w.prefix, params)


def _materialize(out: Built, device):
    from difftrain.models.base_quant import allocate

    def materialize(name: str) -> torch.Tensor:
        return allocate(out.quantized[name], device)
    return materialize


def _quantize(out: Built, precision: str):
    def quantize(name: str) -> None:
        layer = out.quantized.get(name)
        if layer is not None:
            from difftrain.models.base_quant import quantize_layer
            quantize_layer(layer, precision)
    return quantize


def _read_base(out: Built, path: str, device, lazy: bool) -> dict:
    """A base folder or export into the DiT, each quantized layer allocated as its first rows are read and quantized
    once whole."""
    from difftrain.parallel.pretrained import load_pretrained

    return load_pretrained(out.model["dit"], path, on_loaded=_quantize(out, out.precision),
                           materialize=_materialize(out, device) if lazy else None, skip=out.skip)


def _read_checkpoint(out: Built, path: str, prefix: str, device, lazy: bool, frozen_only: bool = False) -> None:
    """A difftrain checkpoint's ``prefix`` tensors into the model (``frozen_only``: the frozen base of an adapter run,
    the adapters left as seeded). The layers to quantize are read one at a time, each quantized before the next is
    allocated."""
    from difftrain.train.checkpoint import Checkpointer

    model = out.model
    named = {base_name(k): v.detach() for k, v in model.named_parameters() if not (frozen_only and is_adapter(k))}
    held = {f"dit.{n}" for n in out.quantized}
    rest = {k: v for k, v in named.items() if k not in held and not v.is_meta}
    if rest:
        Checkpointer.load_tensors(path, prefix, rest)
    quantize = _quantize(out, out.precision)
    for name in out.quantized:          # one layer whole in full precision at a time
        if name in out.skip:
            continue
        target = _materialize(out, device)(name) if lazy else out.quantized[name].weight.detach()
        Checkpointer.load_tensors(path, prefix, {f"dit.{name}": target})
        quantize(name)


def _read_adapter_base(out: Built, cfg: Config, info: dict, device, lazy: bool) -> dict:
    """An adapter run's frozen base into a sampler, from where the run read it (DPO's starting checkpoint, or
    ``model.init_from``), refused, naming both, when the base found there is not the one the adapters were trained on.
    Returns the tensors the checkpoint's adapters (and the rows of words the adapter learnt, ``text.new_words``) are to
    be read into; a trained word encoder, frozen under the adapter, is read from the checkpoint here."""
    from difftrain.train.adapters import base_digest, check_same_base
    from difftrain.train.checkpoint import Checkpointer

    model = out.model
    saved = info.get("adapter_base") or {}
    if "dpo" in info:
        from difftrain.train.verification import reference_digest
        start = Checkpointer.read_info(info["dpo"]["init"])
        now = {"source": start["path"], "digest": reference_digest(start, info["dpo"]["weights"])}
        check_same_base(saved, now, Path(info["path"]))
        _read_checkpoint(out, start["path"], info["dpo"]["weights"], device, lazy, frozen_only=True)
    else:
        run_dir = Path(info["path"]).parent.parent
        check_same_base(saved, base_digest(cfg, run_dir, _is_main()), Path(info["path"]))
        _read_base(out, cfg.model.init_from, device, lazy)
    trained = {k: v.detach() for k, v in model.named_parameters() if is_adapter(k) or k == "text.new_words"}
    rest = {k: v.detach() for k, v in model.named_parameters() if not k.startswith("dit.") and k not in trained}
    if rest:
        Checkpointer.load_tensors(info["path"], "model", rest)
    return trained


def _is_main() -> bool:
    from difftrain.parallel.dist import rank_world
    return rank_world()[0] == 0


def check_meta_free(model: nn.Module, where: str) -> None:
    """Every tensor of a built model allocated: a layer left on the meta device is a build that read nothing into
    it."""
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise UserError(f"{where}: {len(left)} parameter(s) were never read ({', '.join(left[:4])} ...)")
