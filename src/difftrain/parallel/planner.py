"""Memory and strategy planner behind ``difftrain plan``: per-GPU bytes and step-time cost of DDP, FSDP2 and
HSDP, each with or without CPU offload, activation checkpointing (AC) and Ulysses context parallelism (cp).

We shard before we recompute: the recommendation is the fastest strategy that fits among those without AC,
then without offload; AC is the last resort, and the table shows what each choice costs.

Bytes on the largest rank (GPU: bf16 autocast over fp32 master weights; ``device="cpu"``: fp32 throughout):
- params / grads: fp32, FSDP2-sharded on dim 0 as ``torch.chunk`` does (rank 0 holds ceil(d0 / world) rows
  of every parameter, the most of any rank); DDP holds full replicas. ema: the trainer's fp32 EMA, likewise.
- optimizer: AdamW exp_avg + exp_avg_sq (fp32, sharded like the params) + one fp32 step scalar a tensor.
- activations: what autograd saves (``block_activation_bytes``, derived op by op from ``layers.py``) for the
  LARGEST task shape at the micro-batch, plus one block's backward working set.
- buffers: FSDP2's working set (the unit running and the one prefetched, its unsharded gradients, the
  previous unit's fp32 reduce-scatter input, the root unit kept gathered) or foreach AdamW's temporary.
- total: the peak over the step's phases (each block's backward, the optimizer step): less than the sum of
  the parts, which peak at different moments.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from difftrain.config.schema import Config
from difftrain.errors import UserError

GiB = 2 ** 30
T5_XXL_ENCODER_PARAMS = 4_762_310_656    # frozen encoders of the FLUX.1 checkpoints, counted on the meta device
CLIP_L_TEXT_PARAMS = 123_060_480
FLUX_VAE_PARAMS = 83_819_683


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
    encoders_on_gpu: bool = True         # frozen text encoders + VAE resident in bf16 for online encoding
    rms_norm_fused: bool = True          # CUDA's fused rms_norm saves its input only (CPU's composite also its output)


# --- the model as the planner sees it ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Unit:
    """``count`` identical FSDP units whose parameters have these (dim 0, elements per row) shapes."""
    count: int
    shapes: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return sum(d0 * rest for d0, rest in self.shapes)

    def shard(self, world: int) -> int:
        """Elements on rank 0, the largest shard: ceil(d0 / world) rows of each parameter (torch.chunk)."""
        return sum(-(-d0 // world) * rest for d0, rest in self.shapes)


@dataclass(frozen=True)
class _Model:
    D: int
    M: int
    H: int
    head_dim: int
    in_channels: int
    text_dim: int
    abs_pos: bool
    double: _Unit
    single: _Unit
    root: _Unit

    @property
    def units(self) -> tuple[_Unit, _Unit, _Unit]:
        return self.double, self.single, self.root

    @property
    def numel(self) -> int:
        return sum(u.count * u.numel for u in self.units)

    @property
    def tensors(self) -> int:
        return sum(u.count * len(u.shapes) for u in self.units)

    def shard(self, world: int) -> int:
        return sum(u.count * u.shard(world) for u in self.units)


def _shapes(params) -> tuple[tuple[int, int], ...]:
    return tuple((p.shape[0], p.numel() // p.shape[0]) if p.ndim else (1, 1) for p in params)


def _model(p) -> _Model:
    """The FSDP units of the MMDiT for ``DiTParams`` p, from a model built on the meta device."""
    from difftrain.models import build_dit

    dit = build_dit(p, device="meta")
    in_blocks = {id(q) for b in (*dit.double_blocks, *dit.single_blocks) for q in b.parameters()}

    def unit(blocks) -> _Unit:
        return _Unit(len(blocks), _shapes(blocks[0].parameters())) if len(blocks) else _Unit(0, ())

    root = _Unit(1, _shapes([q for q in dit.parameters() if id(q) not in in_blocks]))
    return _Model(D=p.hidden, M=int(p.hidden * p.mlp_ratio), H=p.heads, head_dim=p.head_dim,
                  in_channels=p.in_channels, text_dim=p.text_dim, abs_pos=p.abs_pos_embed,
                  double=unit(dit.double_blocks), single=unit(dit.single_blocks), root=root)


def task_shapes(cfg: Config) -> dict[str, tuple[int, int, float]]:
    """{task: (image tokens, text tokens, weight)} for the tasks the config trains (weight > 0)."""
    d, ae = cfg.data, cfg.autoencoder
    factor = 8 if ae.kind == "diffusers" else ae.factor      # FLUX VAE: 8x; pixel-unshuffle: its factor
    per_frame = (d.image_size // (factor * 2)) ** 2          # 2x2 patches of the latent
    frames = {"t2i": (1, d.t2i_weight), "edit": (2, d.edit_weight), "keyframes": (d.frames, d.keyframe_weight)}
    out = {k: (n * per_frame, cfg.text.max_tokens, w) for k, (n, w) in frames.items() if w > 0}
    return out or {"t2i": (per_frame, cfg.text.max_tokens, 1.0)}


# --- activations -------------------------------------------------------------------------------------------------

def block_activation_bytes(kind: str, D: int, M: int, H: int, head_dim: int, img_tokens: int, txt_tokens: int,
                           autocast: bool = True, rms_fused: bool = True, ac: str = "none", samples: int = 1) -> int:
    """Bytes one ``kind`` ('double' | 'single') block saves for backward for ``samples`` samples of
    ``img_tokens`` + ``txt_tokens`` tokens, apart from what all blocks share (RoPE cos/sin, the vector ``vec``).

    ``autocast``: bf16 autocast with bf16 parameters, where (CUDA) layer_norm runs in fp32: it saves an fp32
    copy of its input and returns fp32; else fp32 throughout. Per token, with e = 2 (bf16) or 4 (fp32):
    - each ``_modulate`` feeding a Linear: the LN input in fp32 (4D), the fp32 LN output (saved by
      ``* (1 + scale)``, 4D) and the Linear's input (eD);
    - QK-norm: q and k cast to fp32 (8D, autocast only) and, unless rms_norm is fused, the normalised q, k
      (8D); in fp32 the norm's input is a view of the qkv output, whose whole storage (3eD) stays alive;
    - attention (flash / memory-efficient SDPA): q and k after RoPE, v and the output (eD each) and the fp32
      logsumexp (4H) -- never the S x S matrix; the RoPE products save only cos/sin, not q or k;
    - double stream: proj input (a copy of the attention slice), proj and fc2 outputs (saved by the gates)
      3eD, fc1 output (saved by GELU) and GELU output (saved by fc2) 2eM;
    - single stream: linear1's output e(3D + M) (kept whole by the v view and GELU), linear2's input
      e(D + M) and output eD;
    - small: LN mean/rstd 8 bytes a LN, QK-norm rstd 8H; per sample the modulation vectors.
    ``ac='full'`` keeps the block inputs (eD a token); ``'selective'`` keeps the outputs of matmuls and
    attention (``parallel/ac.py``) and the inputs, recomputing norms, modulation, RoPE, GELU and casts.
    """
    e = 2 if autocast else 4
    S = img_tokens + txt_tokens
    if ac == "full":
        return samples * e * D * S
    if ac == "selective":
        per_token = e * (7 * D + M) if kind == "double" else e * (6 * D + M)
        return samples * ((per_token + 4 * H) * S + e * D * (12 if kind == "double" else 3))
    if ac != "none":
        raise ValueError(f"unknown AC kind {ac!r}")
    modulate = 8 * D + e * D
    qk = (8 * D if autocast else 0) + (0 if rms_fused else 8 * D)
    weights = 4 * head_dim * 4 if autocast else 0                      # fp32 copies of the QK-norm scales
    if kind == "double":
        stream = 2 * modulate + qk + (0 if autocast else 3 * e * D) + 3 * e * D + 2 * e * M + 16 + 8 * H
        joint = 4 * e * D + 4 * H
        return samples * ((stream + joint) * S + 18 * e * D) + weights
    per_token = modulate + qk + e * (3 * D + M) + 3 * e * D + e * (D + M) + e * D + 8 + 12 * H
    return samples * (per_token * S + 5 * e * D) + weights // 2


def _root_activation_bytes(m: _Model, N: int, T: int, autocast: bool) -> int:
    """Per sample, outside the blocks: the final layer's modulate (without autocast its LN input is the whole
    last block output), embedder inputs, RoPE cos/sin, the output, loss terms and the batch itself."""
    e = 2 if autocast else 4
    final = 8 * N * m.D + (e * N * m.D if autocast else 4 * (N + T) * m.D)
    embed = e * N * m.in_channels + e * T * m.text_dim + (N * 48 * 4 if m.abs_pos else 0)
    return final + embed + 4 * (N + T) * m.head_dim + 32 * N * m.in_channels + 4 * e * m.D


def _parse_ac(ac: str) -> tuple[str, int]:
    return ("every", int(ac.split(":", 1)[1])) if ac.startswith("every:") else (ac, 1)


def _block_activations(m: _Model, N: int, T: int, micro: int, ac: str, autocast: bool, fused: bool):
    """Blocks in forward order; per kind what a block saves without AC (``full``) and its backward working
    set (``work``: gradients of its activations, e(2D + M) a token, measured on CPU); per block what it keeps
    under ``ac`` (``every:N`` checkpoints blocks 0, N, 2N, ... as ``parallel/ac.py``)."""
    kind, every = _parse_ac(ac)
    blocks = ["double"] * m.double.count + ["single"] * m.single.count

    def act(k: str, mode: str) -> int:
        return block_activation_bytes(k, m.D, m.M, m.H, m.head_dim, N, T, autocast, fused, mode, micro)

    full = {k: act(k, "none") for k in ("double", "single")}
    mode = "full" if kind == "every" else kind
    kept = [act(k, mode) if kind != "every" or i % every == 0 else full[k] for i, k in enumerate(blocks)]
    work = {k: micro * (2 if autocast else 4) * (2 * m.D + m.M) * (N + T) for k in full}
    return blocks, full, kept, work


def estimate_single_gpu(params, img_tokens: int, txt_tokens: int, micro_batch: int = 1, ac: str = "none") -> int:
    """Peak bytes of one training step of an unsharded DiT (``DiTParams``) on one CUDA GPU, as
    ``bench/gpu_suite.py`` runs it: fp32 params and grads, fused AdamW (state and step scalars on the GPU, no
    temporaries), bf16 autocast whose weight copies are cached for the forward and saved for backward (not
    under AC), and eager activations (per-block torch.compile saves less: this is then an upper bound)."""
    m = _model(params)
    blocks, full, kept, work = _block_activations(m, img_tokens, txt_tokens, micro_batch, ac, True, True)
    numel = {"double": m.double.numel, "single": m.single.numel}
    resident = 12 * m.numel + 4 * m.tensors                       # params, exp_avg, exp_avg_sq, step
    root_act = micro_batch * _root_activation_bytes(m, img_tokens, txt_tokens, True)
    peak = max(resident + 4 * m.numel,                              # the optimizer step
               resident + root_act + sum(kept) + 2 * m.numel)      # end of forward: every bf16 copy cached
    for i in reversed(range(len(blocks))):
        k = blocks[i]
        cached = sum(numel[b] for j, b in enumerate(blocks[:i]) if kept[j] == full[b])   # blocks without AC
        casts = 2 * (m.root.numel + numel[k] + cached)
        grads = 4 * (m.root.numel + sum(numel[b] for b in blocks[i + 1:]))
        live = root_act + sum(kept[:i]) + full[k] + work[k] + 2 * numel[k]   # + the block's bf16 weight grads
        peak = max(peak, resident + casts + grads + live)
    return peak


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
    fits: bool = False
    problems: list[str] = field(default_factory=list)
    per_gpu_bytes: dict = field(default_factory=dict)
    host_bytes: int = 0
    step_time_cost: dict = field(default_factory=dict)
    recommended: bool = False

    @property
    def settings(self) -> dict:
        return {"parallel.dp_replicate": self.dp_replicate, "parallel.dp_shard": self.dp_shard,
                "parallel.cp": self.cp, "parallel.ac": self.ac, "parallel.cpu_offload": self.cpu_offload}

    def rank_key(self) -> tuple:
        """Sharding before recomputation: no AC first, then no offload, then the fastest, then less traffic."""
        t = self.step_time_cost
        return self.ac != "none", self.cpu_offload, round(t["step_s"], 3), t["comm_s"]

    def to_json(self) -> dict:
        return {"name": self.name, "fits": self.fits, "recommended": self.recommended, "base": self.base,
                "ac": self.ac, "cpu_offload": self.cpu_offload, "settings": self.settings,
                "problems": list(self.problems), "per_gpu_bytes": dict(self.per_gpu_bytes),
                "host_bytes": self.host_bytes, "step_time_cost": dict(self.step_time_cost)}


@dataclass
class _Ctx:
    cfg: Config
    model: _Model
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
    def largest(self) -> tuple[str, int, int]:
        name = max(self.tasks, key=lambda k: sum(self.tasks[k][:2]))
        return name, self.tasks[name][0], self.tasks[name][1]


def _encoder_bytes(cx: _Ctx) -> int:
    cfg = cx.cfg
    if not cx.a.encoders_on_gpu:
        return 0
    n = (T5_XXL_ENCODER_PARAMS + CLIP_L_TEXT_PARAMS if cfg.text.kind == "hf" else 0)
    n += FLUX_VAE_PARAMS if cfg.autoencoder.kind == "diffusers" else 0
    return n * (4 if cfg.text.dtype == "fp32" or (cx.device == "cpu" and cfg.text.dtype == "auto") else 2)


def _evaluate(s: Strategy, cx: _Ctx, micro_override: int | None = None, timing: bool = True) -> Strategy:
    m, cfg = cx.model, cx.cfg
    W, dp, G = s.dp_shard * s.cp, s.dp_replicate * s.dp_shard, cfg.train.global_batch  # FSDP: dp_shard x cp
    s.problems = [] if G % dp == 0 else [f"train.global_batch = {G} is not divisible by the data-parallel "
                                         f"size {dp}"]
    share = max(1, G // dp)
    micro = micro_override or min(cfg.train.micro_batch or share, share)
    if micro_override is None and share % (cfg.train.micro_batch or share):
        s.problems.append(f"train.micro_batch = {cfg.train.micro_batch} does not divide the per-rank share {share}")
    accum = math.ceil(share / micro)
    e = 2 if cx.autocast else 4                 # unsharded compute copies of the params
    shard = m.shard(W)
    params = grads = 4 * shard
    optimizer = 8 * shard + 4 * m.tensors
    ema = 4 * shard if cfg.train.ema_decay > 0 else 0
    s.host_bytes = (params + grads + optimizer + ema) if s.cpu_offload else 0
    if s.cpu_offload:
        params = grads = optimizer = ema = 0
    encoders = _encoder_bytes(cx)

    _, N, T = cx.largest                        # this rank's 1/cp of the largest task's sequence
    N, T = -(-N // s.cp), -(-T // s.cp)
    blocks, full, kept, work = _block_activations(m, N, T, micro, s.ac, cx.autocast,
                                                  cx.a.rms_norm_fused and cx.device == "cuda")
    unit = {"double": m.double, "single": m.single}
    root_act = micro * _root_activation_bytes(m, N, T, cx.autocast)
    root_gathered = 2 * e * m.root.numel        # the root unit's gathered params and unsharded grads

    def unit_buffers(i: int) -> int:
        b = 2 * e * unit[blocks[i]].numel       # gathered params + their unsharded grads
        if i > 0:
            b += e * W * unit[blocks[i - 1]].shard(W)     # the next unit's all-gather output (prefetch)
        if i + 1 < len(blocks):
            b += 4 * W * unit[blocks[i + 1]].shard(W)     # the previous unit's fp32 reduce-scatter input
        return b + (4 * unit[blocks[i]].shard(W) if s.cpu_offload else 0)   # the shard copied in

    resident = params + optimizer + ema + encoders
    grads_before = grads if accum > 1 else 0    # gradients of earlier micro-batches
    peak, phase, at_peak = resident + root_act + sum(kept) + grads_before + root_gathered, "end of forward", {}
    done = grads_before
    for i in reversed(range(len(blocks))):
        k = blocks[i]
        live = root_act + sum(kept[:i]) + full[k] + work[k]
        buf = unit_buffers(i) + root_gathered
        if resident + live + done + buf > peak:
            peak, phase = resident + live + done + buf, f"backward of {k} block {i}"
            at_peak = {"activations": live, "buffers": buf, "grads": done}
        if accum == 1 and not s.cpu_offload:
            done += 4 * unit[k].shard(W)
    opt_step = resident + grads + (0 if s.cpu_offload else 4 * shard)    # foreach AdamW: one shard-sized temp
    if opt_step > peak:
        peak, phase, at_peak = opt_step, "optimizer step", {"activations": 0, "buffers": 4 * shard, "grads": grads}
    s.per_gpu_bytes = {
        "params": params, "grads": grads, "optimizer": optimizer, "ema": ema,
        "activations": root_act + sum(kept) + max((full[k] - kept[i] + work[k] for i, k in enumerate(blocks)),
                                                  default=0),
        "encoders": encoders,
        "buffers": max(root_gathered + max(map(unit_buffers, range(len(blocks))), default=0), opt_step - resident
                       - grads),
        "total": peak, "peak_phase": phase, "at_peak": at_peak, "micro_batch": micro, "grad_accum": accum}
    s.fits = peak <= cx.usable and not s.problems
    if timing:
        s.step_time_cost = _step_time(s, cx, micro, accum, sum(full[k] for k in blocks) - sum(kept))
    return s


def _step_time(s: Strategy, cx: _Ctx, micro: int, accum: int, dropped: int) -> dict:
    from difftrain.parallel.flops import train_flops

    m, a = cx.model, cx.a
    W, e = s.dp_shard * s.cp, (2 if cx.autocast else 4)
    weight = sum(w for _, _, w in cx.tasks.values())
    flops = sum(w * train_flops(cx.dit_params, img_tokens=n, txt_tokens=t) for n, t, w in cx.tasks.values())
    compute = cx.cfg.train.global_batch * flops / weight / (cx.gpus * a.peak_flops * a.mfu)
    kind, every = _parse_ac(s.ac)
    n_blocks = m.double.count + m.single.count
    wrapped = {"none": 0, "selective": 0, "full": n_blocks}.get(kind, math.ceil(n_blocks / every))
    recompute = compute / 3 * wrapped / max(1, n_blocks)          # one more forward of each wrapped block
    if kind == "selective":
        recompute = accum * 3 * dropped / a.hbm_bytes_per_s     # element-wise ops re-read and re-written
    within_node = W <= cx.gpn
    bw = a.nvlink_bytes_per_s if within_node else a.ib_bytes_per_s
    frac = (W - 1) / W
    padded, root_padded = W * m.shard(W), W * m.root.shard(W)
    # per micro-batch: all-gather forward (every unit) and backward (blocks), fp32 reduce-scatter
    comm = accum * ((2 * padded - root_padded) * e + padded * 4) * frac / bw
    if s.dp_replicate > 1:                      # all-reduce of the sharded gradients across replicas
        ar_bw = a.ib_bytes_per_s if cx.nodes > 1 else a.nvlink_bytes_per_s
        comm += accum * 8 * m.shard(W) * (s.dp_replicate - 1) / s.dp_replicate / ar_bw
    cp_comm = 0.0
    if s.cp > 1:                                # Ulysses: q, k, v, out all-to-all, forward and backward
        _, N, T = cx.largest
        per_layer = 8 * micro * -(-(N + T) // s.cp) * m.D * e * (s.cp - 1) / s.cp
        cp_comm = accum * (n_blocks + wrapped / 2) * per_layer / a.nvlink_bytes_per_s
    offload = host_adam = 0.0
    if s.cpu_offload:
        offload = accum * 3 * 4 * m.shard(W) / a.pcie_bytes_per_s   # params in (forward, backward), grads out
        host_adam = 28 * m.shard(W) / a.host_adam_bytes_per_s
    biggest = max((u.numel for u in (m.double, m.single) if u.count), default=m.root.numel)
    exposed = max(0.0, comm + offload - compute - recompute) + accum * e * biggest * frac / bw
    extra = recompute + exposed + cp_comm + host_adam
    return {"compute_s": compute, "recompute_s": recompute, "comm_s": comm, "exposed_comm_s": exposed,
            "cp_comm_s": cp_comm, "offload_s": offload + host_adam, "extra_s": extra,
            "extra_fraction": extra / compute if compute else 0.0, "step_s": compute + extra,
            "fsdp_link": "NVLink" if within_node else "InfiniBand"}


def _strategy(cx: _Ctx, base: str, rep: int, shard: int, cp: int, ac: str, off: bool) -> Strategy:
    W = shard * cp
    name = ("ddp" if base == "ddp" else f"{base}({W})") + (f"+cp{cp}" if cp > 1 else "")
    name += ("+offload" if off else "") + (f"+ac:{ac}" if ac != "none" else "")
    return _evaluate(Strategy(name, base, rep, shard, cp, ac, off), cx)


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
                     bool(getattr(par, "cpu_offload", False)))


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
        cols = ("params", "grads", "optimizer", "ema", "activations", "encoders", "buffers", "total")
        lines = [f"{c['gpus']} GPU(s) x {c['gpu_mem_gb']:g} GB ({c['usable_bytes'] / GiB:.1f} GiB usable), "
                 f"{c['nodes']} node(s); largest task {c['largest_task']['name']} ({c['largest_task']['tokens']} "
                 f"tokens), micro-batch {c['micro_batch']}; GiB per GPU",
                 f"  {'strategy':34} fits " + " ".join(f"{k[:7]:>7}" for k in cols) + "  step_s   extra"]
        extra = self.configured is not None and self.configured not in self.strategies
        rows = self.strategies + ([self.configured] if extra else [])
        for s in rows:
            b, t = s.per_gpu_bytes, s.step_time_cost
            mark = "*" if s.recommended else ("c" if s is self.configured else " ")
            lines.append(f"{mark} {s.name:34} {'yes' if s.fits else 'no ':4} "
                         + " ".join(f"{b[k] / GiB:7.1f}" for k in cols)
                         + f" {t['step_s']:7.2f} {100 * t['extra_fraction']:+6.0f}%")
        lines.append("* recommended" + (", c = the config's [parallel] settings" if self.configured else "")
                     + "; extra = recomputation + exposed communication + offload over compute.")
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
        s = _evaluate(Strategy("fsdp", "fsdp", 1, n // cp, cp, ac, False), sub, micro_override=1, timing=False)
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
        out.append({"kind": "more_gpus", "ac": ac, "cp": c, "min_gpus": n,
                    "text": f"{what} on >= {n} GPUs at micro-batch 1" if n else
                    f"{what} on no number of GPUs (activations, encoders and buffers alone exceed the memory)"})
    for s0 in strategies:                       # a smaller micro-batch (a divisor of the rank's share)
        micro, share = s0.per_gpu_bytes["micro_batch"], max(1, G // (s0.dp_replicate * s0.dp_shard))
        for m in (m for m in range(micro - 1, 0, -1) if share % m == 0):
            if _evaluate(dataclasses.replace(s0), cx, m, timing=False).per_gpu_bytes["total"] <= cx.usable:
                out.append({"kind": "micro_batch", "micro_batch": m, "strategy": s0.name,
                            "text": f"train.micro_batch = {m} with {s0.name}"})
                break
        if out[-1]["kind"] == "micro_batch":
            break
    if cx.a.encoders_on_gpu and _encoder_bytes(cx):
        sub = dataclasses.replace(cx, a=dataclasses.replace(a, encoders_on_gpu=False))
        fit = [s.name for s in _strategies(sub) if s.fits]
        if fit:
            out.append({"kind": "encoders_off_gpu", "strategy": fit[0],
                        "text": f"{fit[0]} with precomputed text embeddings and latents (no encoders on the GPU)"})
    msg = (f"Nothing fits on {cx.gpus} GPU(s) of {cx.usable / GiB:.1f} GiB usable (the least is {best.name} at "
           f"{total / GiB:.1f} GiB). What would fit: " + "; ".join(s["text"] for s in out) + ".")
    return out, msg


def plan(cfg: Config, gpus: int, gpu_mem_gb: float, nodes: int | None = None, gpus_per_node: int = 8,
         device: str = "cuda", assumptions: Assumptions | None = None) -> Plan:
    """Evaluate every strategy on ``gpus`` GPUs of ``gpu_mem_gb`` GB each and recommend one.

    GB are read as GiB, which is how nvidia-smi shows the spec sheets' figures (an H200's '141 GB' is 140 GiB);
    the usable part subtracts the CUDA context and allocator headroom. ``device="cpu"`` plans an fp32 CPU run
    (no autocast, no bf16 copies; all of ``gpu_mem_gb`` usable). Raises ``UserError`` on impossible inputs;
    when nothing fits, ``Plan.fits`` is False and ``Plan.message`` says what would."""
    nodes, gpn = _check_inputs(gpus, gpu_mem_gb, nodes, gpus_per_node, device)
    a = assumptions or Assumptions()
    from difftrain.models import config_dit_params

    dit_params = config_dit_params(cfg)
    model = _model(dit_params)
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
    if configured is not None and not configured.fits:
        notes.append(f"the config's own settings ({configured.name}) do not fit: "
                     + ("; ".join(configured.problems) or f"{configured.per_gpu_bytes['total'] / GiB:.1f} GiB"))
    name, N, T = cx.largest
    context = {
        "gpus": gpus, "nodes": nodes, "gpus_per_node": gpn, "gpu_mem_gb": gpu_mem_gb, "device": device,
        "usable_bytes": cx.usable, "model_params": model.numel, "param_tensors": model.tensors,
        "largest_task": {"name": name, "img_tokens": N, "txt_tokens": T, "tokens": N + T},
        "tasks": {k: {"img_tokens": n, "txt_tokens": t, "weight": w} for k, (n, t, w) in cx.tasks.items()},
        "global_batch": cfg.train.global_batch, "micro_batch": cfg.train.micro_batch or "the rank's share",
        "precision": "bf16 autocast over fp32 master weights" if cx.autocast else "fp32",
        "conventions": [
            "bytes are the largest rank's; total is the peak over the step's phases, not the sum of the parts",
            "gradients are reduce-scattered every micro-batch (skipping that sync, set_gradient_sync, would add "
            "the whole model's unsharded gradients)",
            "frozen encoders (T5-XXL 4.76B + CLIP-L 123M params, FLUX VAE 84M) sit on every GPU in bf16 for online "
            "encoding" if a.encoders_on_gpu else "no frozen encoders on the GPU (precomputed embeddings)",
            "the small trainable 'words' text encoder is not counted",
            "step time is for the config's task mixture; FSDP traffic overlaps compute (only the excess is exposed); "
            "Ulysses all-to-alls and the host AdamW step under offload do not overlap"]}
    return Plan(strategies, best.name if best else None, context, a, suggestions, message, notes, configured)
