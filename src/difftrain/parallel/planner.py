"""Strategy planner behind ``difftrain plan``: per-GPU bytes (``parallel/memory.py``) and step-time cost of DDP,
FSDP2 and HSDP, each with or without CPU offload, activation checkpointing (AC) and Ulysses context parallelism.

We shard before we recompute: the recommendation is the fastest strategy that fits among those without AC,
then without offload; AC is the last resort, and the table shows what each choice costs. With accumulation,
each strategy is evaluated with ``parallel.grad_sync`` 'last' (one reduction a step, the DiT's unsharded fp32
gradients held meanwhile) and 'every' (a reduce-scatter each micro-batch) and keeps the one that fits, then
the faster; ``alternative`` says what the other costs."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

from difftrain.config.schema import Config
from difftrain.errors import UserError
from difftrain.parallel.memory import (Inventory, block_activation_bytes, bucket_shapes, estimate_single_gpu,
                                       frozen_encoder_bytes, inventory, parse_ac, rank_bytes, task_shapes,
                                       text_encoders_resident)

__all__ = ["Assumptions", "Plan", "Strategy", "block_activation_bytes", "estimate_single_gpu", "plan",
           "task_shapes"]
GiB = 2 ** 30
STAGING_PIECE_BYTES = 8 << 20     # the one host buffer a blocking save copies through (train/verification.CHUNK)


@dataclass(frozen=True)
class Assumptions:
    peak_flops: float = 989e12           # dense bf16 per GPU, H100/H200 SXM (REFERENCES.md)
    mfu: float = 0.35                    # published FSDP2 / Megatron DiT runs: 23-52% (REFERENCES.md)
    nvlink_bytes_per_s: float = 360e9    # NCCL bus bandwidth per GPU inside a node (NVLink 4)
    ib_bytes_per_s: float = 40e9         # per GPU across nodes (a 400 Gb/s NIC per GPU, ~80% achieved)
    pcie_bytes_per_s: float = 40e9       # host <-> GPU (PCIe Gen5 x16), for CPU offload
    hbm_bytes_per_s: float = 3.35e12     # re-running element-wise ops (selective AC)
    host_adam_bytes_per_s: float = 10e9  # host memory bandwidth per GPU for AdamW on the CPU (offload)
    cuda_context_bytes: int = 3 * GiB // 2   # CUDA context, NCCL and cuBLAS workspaces: outside the allocator
    allocator_headroom: float = 0.08     # caching-allocator fragmentation
    encoders_on_gpu: bool = True         # frozen encoders resident where the run encodes (memory.frozen_encoder_bytes)
    rms_norm_fused: bool = True          # CUDA's fused rms_norm saves its input only (CPU's composite also its output)


# --- strategies ---------------------------------------------------------------------------------------------------

@dataclass
class Strategy:
    name: str
    base: str                   # ddp | fsdp | hsdp
    dp_replicate: int
    dp_shard: int
    cp: int
    ac: str                     # none | selective | full | every:N
    cpu_offload: bool
    grad_sync: str = "last"     # last | every (matters with gradient accumulation)
    fits: bool = False
    problems: list[str] = field(default_factory=list)
    per_gpu_bytes: dict = field(default_factory=dict)
    host_bytes: int = 0
    staging_bytes: int = 0      # host memory (pinned on GPUs) one rank's async checkpoint stages: its save share
    step_time_cost: dict = field(default_factory=dict)
    alternative: dict | None = None     # the other grad_sync: fits, total, step_s
    recommended: bool = False
    worst_bucket: str = ""      # a store curriculum: the (stage/bucket/task) whose micro-step needs the most memory

    @property
    def settings(self) -> dict:
        return {"parallel.dp_replicate": self.dp_replicate, "parallel.dp_shard": self.dp_shard,
                "parallel.cp": self.cp, "parallel.ac": self.ac, "parallel.cpu_offload": self.cpu_offload,
                "parallel.grad_sync": self.grad_sync}

    def rank_key(self) -> tuple:
        """Sharding before recomputation: no AC first, then no offload, then the fastest, then less traffic."""
        t = self.step_time_cost
        return self.ac != "none", self.cpu_offload, round(t["step_s"], 3), t["comm_s"]

    def to_json(self) -> dict:
        keys = ("name", "fits", "recommended", "base", "ac", "cpu_offload", "grad_sync", "settings", "problems",
                "per_gpu_bytes", "host_bytes", "staging_bytes", "step_time_cost", "alternative", "worst_bucket")
        return {k: copy.copy(getattr(self, k)) for k in keys}


@dataclass
class _Ctx:
    cfg: Config
    model: Inventory
    dit_params: object
    gpus: int
    nodes: int
    gpn: int                    # GPUs a node in this plan
    node_size: int              # GPUs a node of the hardware (for "more GPUs")
    usable: int
    device: str
    a: Assumptions
    tasks: dict

    @property
    def autocast(self) -> bool:
        return self.device == "cuda" and self.cfg.train.precision != "fp32"

    @property
    def grad_sync(self) -> str:
        return getattr(getattr(self.cfg, "parallel", None), "grad_sync", "last")

    @property
    def largest(self) -> tuple[str, int, int]:
        name = max(self.tasks, key=lambda k: sum(self.tasks[k][:2]))
        return name, self.tasks[name][0], self.tasks[name][1]


def staging_bytes(m: Inventory, s: Strategy, gpus: int, ema: bool, async_save: bool) -> int:
    """Host bytes one rank's checkpoint staging holds. Async: its save share (``checkpoint_write.save_share``): the
    FSDP shard's fp32 params, AdamW moments (and step counters) and EMA, divided over the dp_replicate replicas
    that hold the same shard, and the replicated text encoder's state divided over every rank. Blocking: the one
    reused piece each write goes through (``checkpoint_write.host_pieces``)."""
    if not async_save:
        return STAGING_PIECE_BYTES
    W = s.dp_shard * s.cp
    per = 4 + 8 + (4 if ema else 0)
    everywhere = 4 * m.tensors + per * m.text_numel + 4 * m.text_tensors     # plain tensors every rank holds
    return per * m.shard(W) // s.dp_replicate + everywhere // gpus


def _evaluate(s: Strategy, cx: _Ctx, micro_override: int | None = None, timing: bool = True) -> Strategy:
    cfg = cx.cfg
    W, dp, G = s.dp_shard * s.cp, s.dp_replicate * s.dp_shard, cfg.train.global_batch  # FSDP: dp_shard x cp
    s.problems = [] if G % dp == 0 else [f"train.global_batch = {G} is not divisible by the data-parallel "
                                         f"size {dp}"]
    share = max(1, G // dp)
    micro = micro_override or min(cfg.train.micro_batch or share, share)
    if micro_override is None and share % (cfg.train.micro_batch or share):
        s.problems.append(f"train.micro_batch = {cfg.train.micro_batch} does not divide the per-rank share {share}")
    accum = math.ceil(share / micro)
    _, N, T = cx.largest                        # this rank's 1/cp of the largest task's sequence
    encoders = frozen_encoder_bytes(cfg, cx.device) if cx.a.encoders_on_gpu else 0
    # in a world of one nothing is wrapped: gradients accumulate in place, as with "every"
    sync = s.grad_sync if cx.gpus > 1 else "every"
    b = rank_bytes(cx.model, W, -(-N // s.cp), -(-T // s.cp), micro, accum, s.ac, sync, s.cpu_offload,
                   cfg.train.ema_decay > 0, encoders, cx.autocast, cx.a.rms_norm_fused and cx.device == "cuda")
    buckets = bucket_shapes(cfg)
    if buckets:        # a store curriculum: the worst of its buckets, each at its own cost-balanced micro-batch
        s.problems = [p for p in s.problems if not p.startswith("train.")]
        worst = None
        for name, n_img, n_txt, bucket, frames in buckets:
            if bucket.global_batch % dp:
                s.problems.append(f"bucket {name}: global batch {bucket.global_batch} is not divisible by the "
                                  f"data-parallel size {dp}")
                continue
            share_b = bucket.global_batch // dp
            micro_b = micro_override or bucket.micro_for(frames, share_b)
            bb = rank_bytes(cx.model, W, -(-n_img // s.cp), -(-n_txt // s.cp), micro_b, math.ceil(share_b / micro_b),
                            s.ac, sync, s.cpu_offload, cfg.train.ema_decay > 0, encoders, cx.autocast,
                            cx.a.rms_norm_fused and cx.device == "cuda")
            if worst is None or bb["total"] > worst[0]["total"]:
                worst = (bb, name, micro_b)
        if worst is not None:
            b, s.worst_bucket = worst[0], worst[1]
    s.host_bytes, recomputed = b.pop("host"), b.pop("recomputed")
    s.staging_bytes = staging_bytes(cx.model, s, cx.gpus, cfg.train.ema_decay > 0, cfg.train.async_checkpoint)
    s.per_gpu_bytes = b
    s.fits = b["total"] <= cx.usable and not s.problems
    if timing:
        s.step_time_cost = _step_time(s, cx, micro, accum, recomputed, sync == "last" and accum > 1)
    return s


def _step_time(s: Strategy, cx: _Ctx, micro: int, accum: int, dropped: int, once: bool) -> dict:
    """Seconds of one step. ``once``: gradients are reduced once, after the last micro-batch (grad_sync
    'last'); else each micro-batch reduce-scatters. Each micro-batch's traffic hides behind its own compute."""
    from difftrain.parallel.flops import train_flops

    m, a = cx.model, cx.a
    W, e = s.dp_shard * s.cp, (2 if cx.autocast else 4)
    weight = sum(w for _, _, w in cx.tasks.values())
    flops = sum(w * train_flops(cx.dit_params, img_tokens=n, txt_tokens=t) for n, t, w in cx.tasks.values())
    compute = cx.cfg.train.global_batch * flops / weight / (cx.gpus * a.peak_flops * a.mfu)
    kind, every = parse_ac(s.ac)
    n_blocks = m.double.count + m.single.count
    wrapped = {"none": 0, "selective": 0, "full": n_blocks}.get(kind, math.ceil(n_blocks / every))
    recompute = compute / 3 * wrapped / max(1, n_blocks)          # one more forward of each wrapped block
    if kind == "selective":
        recompute = accum * 3 * dropped / a.hbm_bytes_per_s     # element-wise ops re-read and re-written
    within_node = W <= cx.gpn
    bw = a.nvlink_bytes_per_s if within_node else a.ib_bytes_per_s
    frac = (W - 1) / W
    padded, root_padded = W * m.shard(W), W * m.root.shard(W)
    gather = (2 * padded - root_padded) * e * frac / bw          # a micro-batch's all-gathers, forward and backward
    scatter = padded * 4 * frac / bw                             # one fp32 reduce-scatter of every unit
    replicas = 0.0                              # HSDP: all-reduce of the sharded gradients, after the last micro-batch
    if s.dp_replicate > 1:
        ar_bw = a.ib_bytes_per_s if cx.nodes > 1 else a.nvlink_bytes_per_s
        replicas = 8 * m.shard(W) * (s.dp_replicate - 1) / s.dp_replicate / ar_bw
    # the replicated text encoder: one all-reduce over every GPU after the backward, not overlapped
    text = (8 * m.text_numel * (cx.gpus - 1) / cx.gpus
            / (a.ib_bytes_per_s if cx.nodes > 1 else a.nvlink_bytes_per_s))
    reductions = 1 if once else accum
    comm = accum * gather + reductions * scatter + replicas + text
    cp_comm = 0.0
    if s.cp > 1:                                # Ulysses: q, k, v, out all-to-all, forward and backward
        _, N, T = cx.largest
        per_layer = 8 * micro * -(-(N + T) // s.cp) * m.D * e * (s.cp - 1) / s.cp
        cp_comm = accum * (n_blocks + wrapped / 2) * per_layer / a.nvlink_bytes_per_s
    fetch = put = host_adam = 0.0
    if s.cpu_offload:
        fetch = 2 * 4 * m.shard(W) / a.pcie_bytes_per_s        # a micro-batch's params in (forward, backward)
        put = 4 * m.shard(W) / a.pcie_bytes_per_s              # a reduction's grads out
        host_adam = 28 * m.shard(W) / a.host_adam_bytes_per_s
    offload = accum * fetch + reductions * put
    per_micro = (compute + recompute) / accum
    plain = gather + fetch + (0 if once else scatter + put)
    final = plain + (scatter + put if once else 0) + replicas
    biggest = max((u.numel for u in (m.double, m.single) if u.count), default=m.root.numel)
    exposed = ((accum - 1) * max(0.0, plain - per_micro) + max(0.0, final - per_micro)
               + accum * e * biggest * frac / bw + text)
    extra = recompute + exposed + cp_comm + host_adam
    return {"compute_s": compute, "recompute_s": recompute, "comm_s": comm, "exposed_comm_s": exposed,
            "cp_comm_s": cp_comm, "offload_s": offload + host_adam, "text_allreduce_s": text, "extra_s": extra,
            "extra_fraction": extra / compute if compute else 0.0, "step_s": compute + extra,
            "grad_reductions": reductions, "fsdp_link": "NVLink" if within_node else "InfiniBand"}


def _strategy(cx: _Ctx, base: str, rep: int, shard: int, cp: int, ac: str, off: bool,
              grad_sync: str | None = None) -> Strategy:
    """One strategy; unless ``grad_sync`` is given and where it matters (accumulation on more than one GPU),
    both settings evaluated and the better kept: one that fits, then the faster, then the smaller."""
    W = shard * cp
    name = ("ddp" if base == "ddp" else f"{base}({W})") + (f"+cp{cp}" if cp > 1 else "")
    name += ("+offload" if off else "") + (f"+ac:{ac}" if ac != "none" else "")

    def make(sync: str) -> Strategy:
        return _evaluate(Strategy(name, base, rep, shard, cp, ac, off, sync), cx)

    first = make(grad_sync or cx.grad_sync)
    if grad_sync or first.per_gpu_bytes["grad_accum"] == 1 or cx.gpus == 1:
        return first
    other = make("every" if first.grad_sync == "last" else "last")
    best, alt = sorted((first, other), key=lambda s: (not s.fits, round(s.step_time_cost["step_s"], 3) if s.fits
                                                      else 0, s.per_gpu_bytes["total"]))
    best.alternative = {"grad_sync": alt.grad_sync, "fits": alt.fits, "total": alt.per_gpu_bytes["total"],
                        "step_s": alt.step_time_cost["step_s"]}
    return best


def _cps(cx: _Ctx, group: int) -> list[int]:
    """Ulysses degrees: split the heads, stay inside a node and inside the shard group."""
    return [c for c in (2, 4, 8) if cx.model.H % c == 0 and c <= cx.gpn and group % c == 0]


def _strategies(cx: _Ctx) -> list[Strategy]:
    bases = [("ddp", cx.gpus, 1)] if cx.gpus > 1 else []      # on one GPU, DDP and FSDP are the same
    bases.append(("fsdp", 1, cx.gpus))
    if cx.nodes > 1 and cx.gpn > 1:
        bases.append(("hsdp", cx.nodes, cx.gpn))
    out = []
    for base, rep, shard in bases:
        for off in (False, True):
            for ac in ("none", "selective", "full"):
                out.append(_strategy(cx, base, rep, shard, 1, ac, off))
                if out[-1].fits or base == "ddp":
                    continue
                for c in _cps(cx, shard):       # the smallest cp that fits, else the largest (to show the gap)
                    tried = _strategy(cx, base, rep, shard // c, c, ac, off)
                    if tried.fits or c == _cps(cx, shard)[-1]:
                        out.append(tried)
                        break
    return out


def _configured(cx: _Ctx) -> Strategy | None:
    """The config's own ``[parallel]`` mesh at this GPU count, or None with no such section."""
    from difftrain.parallel.dist import resolve_mesh

    par = getattr(cx.cfg, "parallel", None)
    if par is None:
        return None
    sizes = {k: getattr(par, k, d) for k, d in (("dp_replicate", 1), ("dp_shard", -1), ("cp", 1))}
    mesh = resolve_mesh(sizes, cx.gpus)
    base = "ddp" if mesh["dp_shard"] * mesh["cp"] == 1 and cx.gpus > 1 else \
        "hsdp" if mesh["dp_replicate"] > 1 else "fsdp"
    return _strategy(cx, base, mesh["dp_replicate"], mesh["dp_shard"], mesh["cp"], getattr(par, "ac", "none"),
                     bool(getattr(par, "cpu_offload", False)), cx.grad_sync)


# --- the plan -----------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    strategies: list[Strategy]
    recommended: str | None
    context: dict
    assumptions: Assumptions
    suggestions: list[dict]
    message: str
    notes: list[str]
    configured: Strategy | None = None

    @property
    def fits(self) -> bool:
        """False when nothing fits: ``difftrain plan`` then exits with ``message`` as its error."""
        return self.recommended is not None

    def require_fit(self) -> None:
        if not self.fits:
            raise UserError(self.message)

    def to_json(self) -> dict:
        return {"fits": self.fits, "recommended": self.recommended, "message": self.message,
                "strategies": [s.to_json() for s in self.strategies], "suggestions": self.suggestions,
                "notes": self.notes, "configured": self.configured.to_json() if self.configured else None,
                **self.context, "assumptions": dataclasses.asdict(self.assumptions)}

    def table(self) -> str:
        c = self.context
        cols = {"params": "params", "grads": "grads", "accum_grads": "accgrad", "optimizer": "optim", "ema": "ema",
                "activations": "activ", "encoders": "encoder", "buffers": "buffers", "total": "total"}
        lines = [f"{c['gpus']} GPU(s) x {c['gpu_mem_gb']:g} GB ({c['usable_bytes'] / GiB:.1f} GiB usable), "
                 f"{c['nodes']} node(s); largest task {c['largest_task']['name']} ({c['largest_task']['tokens']} "
                 f"tokens), micro-batch {c['micro_batch']}; GiB per GPU",
                 f"  {'strategy':30} fits sync  " + " ".join(f"{k:>7}" for k in cols.values())
                 + "  step_s   extra   stage"]
        extra = self.configured is not None and self.configured not in self.strategies
        rows = self.strategies + ([self.configured] if extra else [])
        for s in rows:
            b, t = s.per_gpu_bytes, s.step_time_cost
            mark = "*" if s.recommended else ("c" if s is self.configured else " ")
            sync = s.grad_sync if b["grad_accum"] > 1 else "-"
            lines.append(f"{mark} {s.name:30} {'yes' if s.fits else 'no ':4} {sync:5} "
                         + " ".join(f"{b[k] / GiB:7.1f}" for k in cols)
                         + f" {t['step_s']:7.2f} {100 * t['extra_fraction']:+6.0f}% {s.staging_bytes / GiB:7.1f}")
        lines.append("* recommended" + (", c = the config's [parallel] settings" if self.configured else "")
                     + "; extra = recomputation + exposed communication + offload over compute; sync = "
                     "parallel.grad_sync with accumulation ('last': accgrad = the DiT's unsharded fp32 gradients); "
                     "stage = host GiB (pinned) a rank's async checkpoint stages: its share of the state.")
        return "\n".join(lines + [self.message] + [f"- {n}" for n in self.notes])


def _check_inputs(gpus, gpu_mem_gb, nodes, gpus_per_node, device) -> tuple[int, int]:
    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    number = isinstance(gpu_mem_gb, (int, float)) and not isinstance(gpu_mem_gb, bool)
    for bad, text in ((not whole(gpus), f"--gpus {gpus!r}: expected a whole number >= 1"),
                      (not (number and 0 < gpu_mem_gb < math.inf), f"--gpu-mem {gpu_mem_gb!r}: expected the GB "
                       "of one GPU, > 0 (e.g. 80 for H100, 141 for H200)"),
                      (not whole(gpus_per_node), f"gpus_per_node {gpus_per_node!r}: expected a whole number >= 1"),
                      (nodes is not None and not whole(nodes), f"--nodes {nodes!r}: expected a whole number >= 1"),
                      (device not in ("cuda", "cpu"), f"device {device!r}: expected 'cuda' or 'cpu'")):
        if bad:
            raise UserError(text)
    if nodes is None:
        if gpus > gpus_per_node and gpus % gpus_per_node:
            raise UserError(f"--gpus {gpus} is not a multiple of {gpus_per_node} GPUs a node: give --nodes")
        nodes = gpus // gpus_per_node if gpus > gpus_per_node else 1
    if gpus % nodes:
        raise UserError(f"--gpus {gpus} is not divisible by --nodes {nodes}: every node must run as many GPUs")
    return nodes, gpus // nodes


def _min_gpus(cx: _Ctx, ac: str, cp: int = 1) -> int | None:
    """The fewest GPUs (whole nodes beyond one) on which FSDP with this AC and cp fits at micro-batch 1, batch
    divisibility aside. Up to ``hidden`` ranks memory falls as the shards shrink, so bisect; beyond, the
    states are negligible and the padding of the all-gather buffers (ceil(d0 / world) rows) grows."""
    ns, limit = cx.node_size, max(cx.node_size, cx.model.D)
    counts = [n for n in (*range(1, ns + 1), *range(2 * ns, limit + 1, ns)) if n % cp == 0]

    def fits(n: int) -> bool:
        sub = dataclasses.replace(cx, gpus=n, nodes=max(1, n // ns), gpn=min(n, ns))
        s = _evaluate(Strategy("fsdp", "fsdp", 1, n // cp, cp, ac, False, "every"), sub, micro_override=1,
                      timing=False)
        return s.per_gpu_bytes["total"] <= cx.usable

    if not counts or not fits(counts[-1]):
        return None
    lo, hi = 0, len(counts) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(counts[mid]) else (mid + 1, hi)
    return counts[lo]


def _suggest(cx: _Ctx, strategies: list[Strategy]) -> tuple[list[dict], str]:
    G = cx.cfg.train.global_batch
    runnable_memory = [s for s in strategies if s.per_gpu_bytes["total"] <= cx.usable]
    if runnable_memory:                         # memory is not the problem: the batch split is
        s = min(runnable_memory, key=lambda s: s.rank_key())
        step = s.dp_replicate * s.dp_shard * (cx.cfg.train.micro_batch or 1)
        near = sorted({max(step, G // step * step), -(-G // step) * step})
        text = (f"{s.name} fits in memory, but {'; '.join(s.problems)}: set train.global_batch to a multiple of "
                f"{step} ({' or '.join(map(str, near))}) or use a GPU count that divides it")
        return [{"kind": "batch", "strategy": s.name, "global_batch": near, "text": text}], f"Nothing runs: {text}."
    best = min(strategies, key=lambda s: s.per_gpu_bytes["total"])
    a, total = cx.a, best.per_gpu_bytes["total"]
    need = (total + a.cuda_context_bytes) / (1 - a.allocator_headroom) / GiB if cx.device == "cuda" else total / GiB
    out = [{"kind": "gpu_mem", "strategy": best.name, "min_gpu_mem_gb": math.ceil(need),
            "text": f"GPUs of >= {math.ceil(need)} GB ({best.name} needs {total / GiB:.1f} GiB)"}]
    cp = max([c for c in (2, 4, 8) if cx.model.H % c == 0 and c <= cx.node_size] or [1])
    for ac, c in dict.fromkeys((("none", 1), ("none", cp), ("full", 1), ("full", cp))):
        n = _min_gpus(cx, ac, c)
        what = "FSDP" + (f" + cp{c}" if c > 1 else "") + (" + full AC" if ac == "full" else " without AC")
        sync = "every" if n and G // (n // c) > 1 else None      # accumulating: reduce every micro-batch
        out.append({"kind": "more_gpus", "ac": ac, "cp": c, "min_gpus": n, "grad_sync": sync,
                    "text": f"{what} on >= {n} GPUs at micro-batch 1"
                    + (" with parallel.grad_sync = every" if sync else "") if n else
                    f"{what} on no number of GPUs (activations, encoders and buffers alone exceed the memory)"})
    for s0 in strategies:                       # a smaller micro-batch (a divisor of the rank's share)
        micro, share = s0.per_gpu_bytes["micro_batch"], max(1, G // (s0.dp_replicate * s0.dp_shard))
        for m in (m for m in range(micro - 1, 0, -1) if share % m == 0):
            b = _evaluate(dataclasses.replace(s0, grad_sync="every"), cx, m, timing=False).per_gpu_bytes
            if b["total"] <= cx.usable:
                sync = " and parallel.grad_sync = every" if b["grad_accum"] > 1 else ""
                out.append({"kind": "micro_batch", "micro_batch": m, "strategy": s0.name,
                            "text": f"train.micro_batch = {m} with {s0.name}{sync}"})
                break
        if out[-1]["kind"] == "micro_batch":
            break
    if cx.a.encoders_on_gpu and frozen_encoder_bytes(cx.cfg, cx.device) and cx.cfg.data.source != "store":
        sub = dataclasses.replace(cx, a=dataclasses.replace(a, encoders_on_gpu=False))
        fit = [s.name for s in _strategies(sub) if s.fits]
        if fit:
            out.append({"kind": "encoders_off_gpu", "strategy": fit[0],
                        "text": f"{fit[0]} with precomputed text embeddings and latents (no encoders on the GPU)"})
    msg = (f"Nothing fits on {cx.gpus} GPU(s) of {cx.usable / GiB:.1f} GiB usable (the least is {best.name} at "
           f"{total / GiB:.1f} GiB). What would fit: " + "; ".join(s["text"] for s in out) + ".")
    return out, msg


def _muon_note(m, best) -> str:
    """What planning train.optimizer = 'muon' as AdamW gets wrong, in bytes: less state, the owner exchange of the
    matrices' updates and the whole matrices an owner holds for the iteration."""
    mats = [(u.count, r * c) for u in (m.double, m.single) for r, c in u.shapes if c > 1]
    hidden, largest = sum(n * e for n, e in mats), max((e for _, e in mats), default=0)
    w = 1 if best is None else best.dp_shard * best.cp
    share = 4 * -(-hidden // w) / GiB                  # fp32: a rank's shards, or the matrices it owns
    return (f"train.optimizer = 'muon' is planned as AdamW: Muon keeps 4 bytes, not 8, an element of the blocks' "
            f"{hidden:,} matrix parameters (the plan overstates the state by {share:.1f} GiB a GPU"
            + (f" at {best.name}" if best is not None else "") + "), and each of those matrices has one owner rank "
            + (f"of the {w} it is sharded over: a step each rank sends its fp32 shards of every matrix once (about "
               f"{share:.2f} GiB) and receives the whole of the matrices it owns (about {share:.2f} GiB, owners "
               "balanced by size), then the reverse, the owners' Newton-Schulz results back to the shards"
               if w > 1 else "(unsharded: no exchange)")
            + f"; an owner holds a matrix whole for the iteration (the largest, {largest:,} elements: about "
            f"{largest * 10 / GiB:.2f} GiB with the bf16 Newton-Schulz work, not counted)")


def _encoders_note(cfg: Config, a: Assumptions, device: str) -> str:
    if not a.encoders_on_gpu:
        return "no frozen encoders on the GPU (precomputed embeddings)"
    if cfg.text.kind != "hf" and cfg.autoencoder.kind != "diffusers":
        return "no frozen encoders (the text encoder is trained; the autoencoder has no weights)"
    text = text_encoders_resident(cfg)
    return (f"frozen encoders on every GPU: {frozen_encoder_bytes(cfg, device) / GiB:.1f} GiB ("
            + ("T5-XXL 4.76B + CLIP-L 123M params" + (", T5's linears in fp8" if cfg.text.precision == "fp8" else "")
               + (" built for online encoding" if cfg.data.source != "store" and not cfg.dpo.pairs
                  else " built at the first preview (train.sample_every)") if text
               else "text encoders not built while training: the store holds their states; built for the "
                    "end-of-run sample" if cfg.text.kind == "hf" else "")
            + ("; " if text or cfg.text.kind == "hf" else "")
            + ("the FLUX VAE 84M, built with the run" if cfg.autoencoder.kind == "diffusers" else "no VAE weights")
            + ")")


def plan(cfg: Config, gpus: int, gpu_mem_gb: float, nodes: int | None = None, gpus_per_node: int = 8,
         device: str = "cuda", assumptions: Assumptions | None = None, vocabulary: list[str] | None = None) -> Plan:
    """Evaluate every strategy on ``gpus`` GPUs of ``gpu_mem_gb`` GB each and recommend one.

    GB are read as GiB, which is how nvidia-smi shows the spec sheets' figures (an H200's '141 GB' is 140 GiB);
    the usable part subtracts the CUDA context and allocator headroom. ``device="cpu"`` plans an fp32 CPU run
    (no autocast, no bf16 copies; all of ``gpu_mem_gb`` usable). Raises ``UserError`` on impossible inputs;
    when nothing fits, ``Plan.fits`` is False and ``Plan.message`` says what would. ``vocabulary``: the data's
    words, for a config that trains a word text encoder (``difftrain.sources.vocabulary_for``)."""
    nodes, gpn = _check_inputs(gpus, gpu_mem_gb, nodes, gpus_per_node, device)
    a = assumptions or Assumptions()
    from difftrain.models import config_dit_params

    dit_params = config_dit_params(cfg)
    model = inventory(dit_params, cfg, vocabulary)
    usable = gpu_mem_gb * GiB
    if device == "cuda":
        usable = usable * (1 - a.allocator_headroom) - a.cuda_context_bytes
    cx = _Ctx(cfg, model, dit_params, gpus, nodes, gpn, gpn if nodes > 1 else max(gpn, gpus_per_node),
              int(usable), device, a, task_shapes(cfg))
    strategies = _strategies(cx)
    notes, suggestions = [], []
    configured = None
    try:
        configured = _configured(cx)
    except UserError as err:
        notes.append(f"the config's [parallel] mesh does not run on {gpus} GPUs: {err}")
    same = [s for s in strategies if configured is not None and s.settings == configured.settings]
    configured = same[0] if same else configured
    fitting = [s for s in strategies if s.fits]
    if fitting:
        best = min(fitting, key=Strategy.rank_key)
        best.recommended = True
        message = f"Recommended: {best.name} (" + ", ".join(f"{k}={v}" for k, v in best.settings.items()) + ")."
        fastest = min(fitting, key=lambda s: s.step_time_cost["step_s"])
        gain = best.step_time_cost["step_s"] - fastest.step_time_cost["step_s"]
        if gain > max(0.01, 0.02 * best.step_time_cost["step_s"]):     # it uses AC or offload
            notes.append(f"{fastest.name} is estimated {gain:.2f} s/step faster: here its recomputation or offload "
                         "costs less than the traffic that sharding adds")
    else:
        best = None
        suggestions, message = _suggest(cx, strategies)
    if cfg.train.optimizer == "muon":
        notes.append(_muon_note(model, best))
    if configured is not None and not configured.fits:
        notes.append(f"the config's own settings ({configured.name}) do not fit: "
                     + ("; ".join(configured.problems) or f"{configured.per_gpu_bytes['total'] / GiB:.1f} GiB"))
    name, N, T = cx.largest
    context = {
        "gpus": gpus, "nodes": nodes, "gpus_per_node": gpn, "gpu_mem_gb": gpu_mem_gb, "device": device,
        "usable_bytes": cx.usable, "model_params": model.numel, "param_tensors": model.tensors,
        "text_encoder_params": model.text_numel, "grad_sync": cx.grad_sync,
        "largest_task": {"name": name, "img_tokens": N, "txt_tokens": T, "tokens": N + T},
        "tasks": {k: {"img_tokens": n, "txt_tokens": t, "weight": w} for k, (n, t, w) in cx.tasks.items()},
        "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch or "the rank's share",
        "buckets": {n: {"img_tokens": i, "txt_tokens": t, "global_batch": b.global_batch, "frames": f,
                        "micro_batch_cap": b.micro_batch or (f"micro_cost {b.micro_cost:g} / tokens^{b.cost_power:g}"
                                                             if b.micro_cost else "the rank's share")}
                    for n, i, t, b, f in bucket_shapes(cfg)},
        "precision": "bf16 autocast over fp32 master weights" if cx.autocast else "fp32",
        "conventions": [
            "bytes are the largest rank's; total is the peak over the step's phases, not the sum of the parts",
            "with gradient accumulation each strategy keeps the better parallel.grad_sync: 'last' reduces once a step "
            "but holds the whole DiT's unsharded fp32 gradients (accum_grads) on every GPU until then; 'every' "
            "reduce-scatters each micro-batch (HSDP's cross-replica all-reduce still once a step)",
            _encoders_note(cfg, a, device),
            "a trainable 'words' text encoder is replicated: its params, grads, AdamW state and EMA are counted "
            "whole on every GPU (its activations are not) and its gradients cost one all-reduce a step",
            "step time is for the config's task mixture; FSDP traffic overlaps compute (only the excess is exposed); "
            "Ulysses all-to-alls and the host AdamW step under offload do not overlap"]}
    return Plan(strategies, best.name if best else None, context, a, suggestions, message, notes, configured)
