"""``difftrain plan`` for a run with an adapter (``adapter.kind`` lora / lokr): per-GPU memory of each
``adapter.base_precision`` on GPUs of 24, 48 and 80 GB (and the one asked for), at the planned world size.

What a rank holds: the frozen base (bf16: 2 bytes a weight, sharded by FSDP2 over the ranks, one block gathered and
the next prefetched; fp8: 1 byte a weight plus a float32 scale a row; nf4: half a byte plus its block scales, 0.53
bytes a weight -- the quantized block linears whole on every rank, the rest of the DiT in bf16 and sharded); the
adapters with their gradients, AdamW moments and EMA (20 bytes a parameter, sharded); the activations of the largest
micro-batch (the trainer's own estimate, ``memory.block_activations``: the base frozen, the blocks still keep what the
adapters' backward needs); the frozen encoders; the CUDA context and allocator headroom (``planner.Assumptions``).
"""

from __future__ import annotations

from torch import nn

from difftrain.config.schema import Config

GiB = 2 ** 30
SIZES_GB = (24, 48, 80)
BYTES = {"bf16": 2.0, "fp8": 1.0, "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}   # a weight, scales included
ADAPTER_STATE = 4 + 4 + 8 + 4          # fp32 parameter, gradient, two AdamW moments, EMA
# torchao's conversion of one weight, for a moment, bytes a weight of the layer being quantized (beside its fp32 copy):
# fp8 13, nf4 137 (NF4's nearest-level search holds a distance to each of the 16 levels), measured on a CPU with torch
# 2.13 and torchao 0.18 (``python bench/build_ledger.py --probe``); at FLUX's widest linear (3072 x 12288) nf4's is
# 5.2 GB, more than the quantized base's largest block
QUANTIZE_SCRATCH = {"fp8": 14, "nf4": 140}


def adapter_numel(dit: nn.Module, kind: str, rank: int, targets) -> tuple[int, int]:
    """(adapter parameters, target layers) of a DiT built on the meta device."""
    from difftrain.models.lora import target_layers

    n = 0
    names = target_layers(dit, targets)
    modules = dict(dit.named_modules())
    for name in names:
        out_f, in_f = modules[name].weight.shape
        if kind == "lora":
            n += rank * (in_f + out_f)
        else:   # LoKr: a full small factor and a low-rank large one (peft's factorisation), about r (in + out) / 2
            n += rank * (in_f + out_f) // 2 + 64
    return n, len(names)


def base_bytes(precision: str, total: int, block_linear: int, rows: int, world: int, block: int = 0,
               weight_bytes: float = 2.0) -> float:
    """A rank's bytes of the frozen base: ``weight_bytes`` a weight (bf16: 2) sharded over ``world`` ranks, with a
    block of ``block`` weights gathered and the next prefetched; quantized (fp8, nf4), the block linears' weights
    (``block_linear`` of them, ``rows`` output rows) whole on every rank at ``BYTES`` a weight (fp8: and a float32
    scale a row), the rest sharded."""
    if precision == "bf16":
        return weight_bytes * total / world + (2 * weight_bytes * block if world > 1 else 0)
    rest = total - block_linear
    return BYTES[precision] * block_linear + (4 * rows if precision == "fp8" else 0) + weight_bytes * rest / world


def _linear_sizes(dit: nn.Module) -> tuple[int, int, int]:
    """(block linears' weights, their output rows, the largest linear's weights) of a DiT on the meta device."""
    linears = [(n, m) for n, m in dit.named_modules() if isinstance(m, nn.Linear)]
    blocks = [m for n, m in linears if n.startswith(("double_blocks.", "single_blocks."))]
    return (sum(m.weight.numel() for m in blocks), sum(m.weight.shape[0] for m in blocks),
            max(m.weight.numel() for _, m in linears))


def _largest_block_linear(dit: nn.Module) -> int:
    return max(m.weight.numel() for n, m in dit.named_modules()
               if isinstance(m, nn.Linear) and n.startswith(("double_blocks.", "single_blocks.")))


def build_ledger(cfg: Config, role: str, weight_bytes: float, precision: str | None = None, world: int = 1) -> dict:
    """The planner's figure for building and loading a model (``train.build.build_model``): the bytes a rank holds
    once it is built (the base, at ``precision``, default ``adapter.base_precision``, with an adapter; its other
    weights at ``weight_bytes``; the adapters in fp32) and the most that reading adds for a moment: two
    full-precision (fp32) copies of the largest linear (the tensor being read and a read buffer); with a quantized
    base, the largest quantized layer whole in fp32 (allocated as its rows are read), a read buffer of it and torchao's
    conversion of it (``QUANTIZE_SCRATCH``), one layer at a time. At FLUX width the largest linear is 3072 x 12288 (150 MB in fp32),
    against 24 GB of a 12B base in bf16. The optimizer, gradients and activations come later (``adapter_plan``,
    ``planner``). ``role``: 'policy', 'reference' or 'sampler' (the reference has no adapter)."""
    from difftrain.models import build_dit, config_dit_params

    dit = build_dit(config_dit_params(cfg), device="meta")
    total = sum(p.numel() for p in dit.parameters())
    block_linear, rows, largest = _linear_sizes(dit)
    adapted = cfg.adapter.kind != "none" and role != "reference"
    precision = (precision or cfg.adapter.base_precision) if adapted else "bf16"
    n_adapter = adapter_numel(dit, cfg.adapter.kind, cfg.adapter.rank, cfg.adapter.targets)[0] if adapted else 0
    resident = base_bytes(precision, total, block_linear, rows, world, 0, weight_bytes) + 4 * n_adapter
    transient = 2 * 4 * largest
    if precision != "bf16":
        transient = max(transient, (4 + 4 + QUANTIZE_SCRATCH[precision]) * _largest_block_linear(dit))
    return {"resident_bytes": int(resident), "transient_bytes": int(transient), "peak_bytes": int(resident + transient),
            "full_precision_base_bytes": int(4 * total), "precision": precision, "adapter_params": n_adapter}


def adapter_plan(cfg: Config, gpus: int, gpu_mem_gb: float, vocabulary=None) -> dict:
    from difftrain.models import build_dit, config_dit_params
    from difftrain.parallel.memory import block_activations, frozen_encoder_bytes, inventory, root_activation_bytes, \
        task_shapes
    from difftrain.parallel.planner import Assumptions

    a = Assumptions()
    params = config_dit_params(cfg)
    dit = build_dit(params, device="meta")
    block_linear = sum(m.weight.numel() for n, m in dit.named_modules()
                       if isinstance(m, nn.Linear) and n.startswith(("double_blocks.", "single_blocks.")))
    rows = sum(m.weight.shape[0] for n, m in dit.named_modules()
               if isinstance(m, nn.Linear) and n.startswith(("double_blocks.", "single_blocks.")))
    total = sum(p.numel() for p in dit.parameters())
    ad = cfg.adapter
    n_adapter, n_layers = adapter_numel(dit, ad.kind, ad.rank, ad.targets)
    inv = inventory(params, cfg, vocabulary)
    W = max(1, gpus)
    micro = cfg.train.micro_batch or max(1, cfg.train.global_batch // W)
    tasks = task_shapes(cfg)
    name, (N, T, _) = max(tasks.items(), key=lambda kv: kv[1][0] + kv[1][1])
    def activations_of(ac: str) -> int:
        _, _, kept, work = block_activations(inv, N, T, micro, ac, True, True)
        return sum(kept) + max(work.values()) + micro * root_activation_bytes(inv, N, T, True)

    acs = [cfg.parallel.ac] + (["full"] if cfg.parallel.ac != "full" else [])
    encoders = frozen_encoder_bytes(cfg, "cuda")
    block = max(inv.double.numel if inv.double.count else 0, inv.single.numel if inv.single.count else 0)
    rows_out = {}
    for precision, ac in ((p_, ac) for p_ in ("bf16", "fp8", "nf4") for ac in acs):
        activations = activations_of(ac)
        base = base_bytes(precision, total, block_linear, rows, W, block)
        adapters = ADAPTER_STATE * n_adapter / W
        need = base + adapters + activations + encoders
        row = {"base_gb": round(base / GiB, 2), "adapter_gb": round(adapters / GiB, 3),
               "activations_gb": round(activations / GiB, 2), "encoders_gb": round(encoders / GiB, 2),
               "total_gb": round(need / GiB, 2)}
        for size in sorted({*SIZES_GB, gpu_mem_gb}):
            usable = size * GiB * (1 - a.allocator_headroom) - a.cuda_context_bytes
            row[f"fits_{size:g}gb"] = need <= usable
        rows_out[f"{precision}" if ac == acs[0] else f"{precision}+ac:{ac}"] = row
    return {"adapter": {"kind": ad.kind, "rank": ad.rank, "targets": n_layers, "params": n_adapter},
            "dit_params": total, "block_linear_params": block_linear, "gpus": W, "micro_batch": micro,
            "largest_task": {"name": name, "img_tokens": N, "txt_tokens": T}, "activation_checkpointing": cfg.parallel.ac,
            "precisions": rows_out, "configured": ad.base_precision,
            "fits": rows_out[ad.base_precision][f"fits_{gpu_mem_gb:g}gb"]}


def table(p: dict, gpu_mem_gb: float) -> str:
    sizes = sorted({*SIZES_GB, gpu_mem_gb})
    head = (f"adapter {p['adapter']['kind']} rank {p['adapter']['rank']} on {p['adapter']['targets']} layers "
            f"({p['adapter']['params'] / 1e6:.1f}M parameters) over a {p['dit_params'] / 1e9:.2f}B-parameter DiT, "
            f"{p['gpus']} GPU(s), micro-batch {p['micro_batch']} of {p['largest_task']['name']} "
            f"({p['largest_task']['img_tokens']} + {p['largest_task']['txt_tokens']} tokens), AC "
            f"{p['activation_checkpointing']}")
    lines = [head, "base_precision       base GiB  adapter GiB  activations GiB  encoders GiB  total GiB  "
             + "  ".join(f"{s:g} GB" for s in sizes)]
    for prec, r in p["precisions"].items():
        mark = "*" if prec == p["configured"] else " "
        lines.append(f"{prec + mark:<20} {r['base_gb']:>8.2f}  {r['adapter_gb']:>11.3f}  {r['activations_gb']:>15.2f}  "
                     f"{r['encoders_gb']:>12.2f}  {r['total_gb']:>9.2f}  "
                     + "  ".join(f"{'fits' if r[f'fits_{s:g}gb'] else '-':>{len(f'{s:g} GB')}}" for s in sizes))
    lines.append("* the config's adapter.base_precision; +ac:full: with parallel.ac = 'full' (activation checkpointing)")
    return "\n".join(lines)
