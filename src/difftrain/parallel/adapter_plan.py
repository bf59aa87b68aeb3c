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
        if precision == "bf16":
            base = 2 * total / W + (2 * 2 * block if W > 1 else 0)       # sharded; a block gathered + the next
        else:
            rest = total - block_linear
            base = BYTES[precision] * block_linear + (4 * rows if precision == "fp8" else 0) + 2 * rest / W
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
