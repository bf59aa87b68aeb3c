"""What one rank holds during a training step of the MMDiT: the model's inventory (its FSDP units and their
shapes), what autograd saves per block, and the peak of live bytes over the step's phases.

Bytes on one rank (GPU: bf16 autocast over fp32 master weights; no autocast: fp32 throughout):
- params / grads: fp32, FSDP2-sharded on dim 0 as ``torch.chunk`` does (rank 0 holds ceil(d0 / world) rows
  of every parameter, the most of any rank); a shard group of one holds full replicas. ema: the trainer's
  fp32 EMA, likewise. A trainable text encoder (the 'words' kind) is not sharded: its parameters, gradients,
  AdamW state and EMA are whole on every rank.
- optimizer: AdamW exp_avg + exp_avg_sq (fp32, sharded like the params) + one fp32 step scalar a tensor.
- accum_grads: with gradient accumulation and ``grad_sync = "last"`` no unit reduces before the last
  micro-batch, so every rank holds the whole DiT's unsharded gradients in the reduce dtype (fp32: FSDP2
  upcasts the bf16 gradients into ``unsharded_accumulated_grad``; an fp32 model accumulates into ``.grad``).
  In the last micro-batch each unit reduce-scatters after its backward and frees them.
- activations: what autograd saves (``block_activation_bytes``, derived op by op from ``layers.py``) for the
  largest task shape at the micro-batch, plus one block's backward working set.
- buffers: FSDP2's working set (the unit running and the one prefetched, its unsharded gradients, the
  previous unit's fp32 reduce-scatter input, the root unit kept gathered; in the forward the all-gather
  outputs of this unit and the previous one) or foreach AdamW's temporary.
- total: the peak over the step's phases (each block's forward, its backward in each kind of micro-batch, the
  optimizer step): less than the sum of the parts, which peak at different moments. Checked against the
  live tensors of real 2-rank steps (``tests/test_planner.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from difftrain.config.schema import Config
from difftrain.errors import UserError

T5_XXL_ENCODER_PARAMS = 4_762_310_656    # frozen encoders of the FLUX.1 checkpoints, counted on the meta device
CLIP_L_TEXT_PARAMS = 123_060_480
FLUX_VAE_PARAMS = 83_819_683
# T5-XXL's linears that text.precision = 'fp8' quantizes: 24 blocks of q, k, v, o (4096 x 4096) and wi_0, wi_1
# (4096 x 10240); the FFN output projections wo (hf_text.KEEP_FP8), embeddings and norms stay in text.dtype.
T5_XXL_FP8_PARAMS = 24 * (4 * 4096 * 4096 + 2 * 4096 * 10240)


@dataclass(frozen=True)
class Unit:
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
class Inventory:
    """The DiT's FSDP units and widths, and the size of a replicated trainable text encoder (0 if none)."""
    D: int
    M: int
    H: int
    head_dim: int
    in_channels: int
    text_dim: int
    abs_pos: bool
    double: Unit
    single: Unit
    root: Unit
    text_numel: int = 0
    text_tensors: int = 0

    @property
    def units(self) -> tuple[Unit, Unit, Unit]:
        return self.double, self.single, self.root

    @property
    def numel(self) -> int:
        """DiT parameters (the text encoder apart)."""
        return sum(u.count * u.numel for u in self.units)

    @property
    def tensors(self) -> int:
        return sum(u.count * len(u.shapes) for u in self.units)

    def shard(self, world: int) -> int:
        return sum(u.count * u.shard(world) for u in self.units)


def _shapes(params) -> tuple[tuple[int, int], ...]:
    return tuple((p.shape[0], p.numel() // p.shape[0]) if p.ndim else (1, 1) for p in params)


def inventory(p, cfg: Config | None = None, vocabulary: list[str] | None = None) -> Inventory:
    """The FSDP units of the MMDiT for ``DiTParams`` p (built on the meta device), and with ``cfg`` its
    trainable text encoder."""
    from difftrain.models import build_dit

    dit = build_dit(p, device="meta")
    in_blocks = {id(q) for b in (*dit.double_blocks, *dit.single_blocks) for q in b.parameters()}

    def unit(blocks) -> Unit:
        return Unit(len(blocks), _shapes(blocks[0].parameters())) if len(blocks) else Unit(0, ())

    text = [0, 0]
    if cfg is not None and cfg.text.kind == "words":
        from difftrain.models import build_text_encoder

        if not vocabulary:
            raise UserError("text.kind = 'words': planning its trained text encoder needs the data's vocabulary")
        ps = [q for q in build_text_encoder(cfg, vocabulary, "meta").parameters() if q.requires_grad]
        text = [sum(q.numel() for q in ps), len(ps)]
    root = Unit(1, _shapes([q for q in dit.parameters() if id(q) not in in_blocks]))
    return Inventory(D=p.hidden, M=int(p.hidden * p.mlp_ratio), H=p.heads, head_dim=p.head_dim,
                     in_channels=p.in_channels, text_dim=p.text_dim, abs_pos=p.abs_pos_embed,
                     double=unit(dit.double_blocks), single=unit(dit.single_blocks), root=root,
                     text_numel=text[0], text_tensors=text[1])


def task_shapes(cfg: Config) -> dict[str, tuple[int, int, float]]:
    """{task: (image tokens, text tokens, weight)} for the tasks the config trains (weight > 0)."""
    d, ae = cfg.data, cfg.autoencoder
    factor = 8 if ae.kind == "diffusers" else ae.factor      # FLUX VAE: 8x; pixel-unshuffle: its factor
    per_frame = (d.image_size // (factor * 2)) ** 2          # 2x2 patches of the latent
    frames = {"t2i": (1, d.t2i_weight), "edit": (2, d.edit_weight), "keyframes": (d.frames, d.keyframe_weight)}
    out = {k: (n * per_frame, cfg.text.max_tokens, w) for k, (n, w) in frames.items() if w > 0}
    return out or {"t2i": (per_frame, cfg.text.max_tokens, 1.0)}


def bucket_shapes(cfg: Config) -> list[tuple[str, int, int, object, int]]:
    """Per (stage, bucket, task) of a store-fed curriculum: (name, image tokens, text tokens, Bucket, frames),
    the same buckets, global batches and cost-balanced micro-batches the store loader uses ([] without one)."""
    if cfg.data.source != "store":
        return []
    from difftrain.config.stages import parse_stages
    d = cfg.data
    frames = {"t2i": (1, d.t2i_weight), "edit": (2, d.edit_weight), "keyframes": (d.frames, d.keyframe_weight)}
    out = []
    for stage in parse_stages(cfg):
        for b in stage.buckets:
            for task, (f, w) in frames.items():
                if w > 0:
                    out.append((f"{stage.name}/{b.name}/{task}", b.tokens(f), cfg.text.max_tokens, b, f))
    return out


def text_encoders_resident(cfg: Config) -> bool:
    """Whether the frozen text encoders ('hf') sit on the GPU while the run trains. They are built on first use
    (``LazyHFTextEncoder``): a run fed by the shapes source encodes every batch; a store holds their states, its
    previews' included (``preview.text = 'auto'``), so a store-fed run builds them only under ``preview.text =
    'encoders'`` with previews on; a DPO pairs cache holds the pairs' states, and its previews build them (from the
    first preview on)."""
    if cfg.text.kind != "hf":
        return False
    if cfg.data.source == "store" and not cfg.dpo.pairs:      # previews read the store's states (preview.text)
        return cfg.train.sample_every > 0 and cfg.preview.text == "encoders"
    return not cfg.dpo.pairs or cfg.train.sample_every > 0


def frozen_encoder_bytes(cfg: Config, device: str, text: bool | None = None) -> int:
    """The frozen text encoders ('hf': T5-XXL + CLIP-L; ``text`` None: when ``text_encoders_resident``) and VAE
    ('diffusers', built with the run) resident while it trains. ``text.precision = 'fp8'`` stores T5's
    quantized linears (all but the FFN output projections ``wo``) in one byte a weight."""
    width = 4 if cfg.text.dtype == "fp32" or (device == "cpu" and cfg.text.dtype == "auto") else 2
    n = 0
    if cfg.text.kind == "hf" and (text_encoders_resident(cfg) if text is None else text):
        fp8 = T5_XXL_FP8_PARAMS if cfg.text.precision == "fp8" and cfg.text.t5_path else 0
        t5 = T5_XXL_ENCODER_PARAMS if cfg.text.t5_path or not cfg.text.clip_path else 0
        clip = CLIP_L_TEXT_PARAMS if cfg.text.clip_path or not cfg.text.t5_path else 0
        n += (t5 - fp8 + clip) * width + fp8
    if cfg.autoencoder.kind == "diffusers":
        n += FLUX_VAE_PARAMS * width
    return n


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


def root_activation_bytes(m: Inventory, N: int, T: int, autocast: bool) -> int:
    """Per sample, outside the blocks: the final layer's modulate (without autocast its LN input is the whole
    last block output), embedder inputs, RoPE cos/sin, the output, loss terms and the batch itself."""
    e = 2 if autocast else 4
    final = 8 * N * m.D + (e * N * m.D if autocast else 4 * (N + T) * m.D)
    embed = e * N * m.in_channels + e * T * m.text_dim + (N * 48 * 4 if m.abs_pos else 0)
    return final + embed + 4 * (N + T) * m.head_dim + 32 * N * m.in_channels + 4 * e * m.D


def parse_ac(ac: str) -> tuple[str, int]:
    return ("every", int(ac.split(":", 1)[1])) if ac.startswith("every:") else (ac, 1)


def block_activations(m: Inventory, N: int, T: int, micro: int, ac: str, autocast: bool, fused: bool):
    """Blocks in forward order; per kind what a block saves without AC (``full``) and its backward working
    set (``work``: gradients of its activations, e(2D + M) a token, measured on CPU); per block what it keeps
    under ``ac`` (``every:N`` checkpoints blocks 0, N, 2N, ... as ``parallel/ac.py``)."""
    kind, every = parse_ac(ac)
    blocks = ["double"] * m.double.count + ["single"] * m.single.count

    def act(k: str, mode: str) -> int:
        return block_activation_bytes(k, m.D, m.M, m.H, m.head_dim, N, T, autocast, fused, mode, micro)

    full = {k: act(k, "none") for k in ("double", "single")}
    mode = "full" if kind == "every" else kind
    kept = [act(k, mode) if kind != "every" or i % every == 0 else full[k] for i, k in enumerate(blocks)]
    work = {k: micro * (2 if autocast else 4) * (2 * m.D + m.M) * (N + T) for k in full}
    return blocks, full, kept, work


# --- the peak of one rank ------------------------------------------------------------------------------------------

def rank_bytes(m: Inventory, W: int, N: int, T: int, micro: int, accum: int, ac: str = "none",
               grad_sync: str = "every", cpu_offload: bool = False, ema: bool = True, encoders: int = 0,
               autocast: bool = True, fused: bool = True) -> dict:
    """Bytes of one rank of a ``W``-way FSDP2 shard group (dp_shard x cp) for micro-batches of ``micro``
    samples of ``N`` image + ``T`` text tokens, ``accum`` of them a step; the parts, the peak (``total``) and
    the phase it is reached in."""
    e = 2 if autocast else 4                    # unsharded compute copies of the params
    shard, text = m.shard(W), m.text_numel
    params = grads = 4 * shard
    optimizer = 8 * shard + 4 * m.tensors
    ema_b = 4 * shard if ema else 0
    host = (params + grads + optimizer + ema_b) if cpu_offload else 0
    if cpu_offload:
        params = grads = optimizer = ema_b = 0
    # the replicated text encoder stays on the GPU, whole
    params, grads, ema_b = params + 4 * text, grads + 4 * text, ema_b + (4 * text if ema else 0)
    optimizer += 8 * text + 4 * m.text_tensors

    blocks, full, kept, work = block_activations(m, N, T, micro, ac, autocast, fused)
    unit = {"double": m.double, "single": m.single}
    root_act = micro * root_activation_bytes(m, N, T, autocast)
    last = grad_sync == "last" and accum > 1
    # a micro-batch's unsharded gradients are new tensors, except in fp32 under "last" after the first
    # micro-batch: autograd then adds them into the gradients held from the earlier micro-batches
    fresh = not last or autocast

    def unit_buffers(i: int, reducing: bool = True, new_grads: bool = fresh) -> int:
        b = e * unit[blocks[i]].numel * (2 if new_grads else 1)    # gathered params + their unsharded grads
        if i > 0:
            b += e * W * unit[blocks[i - 1]].shard(W)     # the next unit's all-gather output (prefetch)
        if reducing and i + 1 < len(blocks):
            b += 4 * W * unit[blocks[i + 1]].shard(W)     # the previous unit's fp32 reduce-scatter input
        return b + (4 * unit[blocks[i]].shard(W) if cpu_offload else 0)   # the shard copied in

    def root_gathered(new_grads: bool = fresh) -> int:
        return e * m.root.numel * (2 if new_grads else 1)      # the root unit's gathered params (+ grads)

    resident = params + optimizer + ema_b + encoders
    acc_all = 4 * m.numel if last else 0       # the whole DiT's unsharded fp32 gradients
    # gradients of earlier micro-batches: the sharded ones ("every"), the text encoder's
    grads_before = (4 * text if last else grads) if accum > 1 else 0
    peak, phase = resident + root_act + sum(kept) + grads_before + acc_all + root_gathered(), "end of forward"
    at_peak: dict = {}

    def consider(total: int, name: str, parts: dict) -> None:
        nonlocal peak, phase, at_peak
        if total > peak:
            peak, phase, at_peak = total, name, parts

    # the forward of block i: its all-gather output copied out into its unsharded params, the previous
    # unit's all-gather output still held (FSDP2 frees it when the next all-gather is waited on)
    forward_buffers = [0]
    for i, k in enumerate(blocks):
        before = unit[blocks[i - 1]].shard(W) if i else m.root.shard(W)
        buf = e * (unit[k].numel + W * (unit[k].shard(W) + before)) + e * m.root.numel
        live = root_act + sum(kept[:i])
        forward_buffers.append(buf)
        consider(resident + live + grads_before + acc_all + buf, f"forward of {k} block {i}",
                 {"activations": live, "buffers": buf, "grads": grads_before, "accum_grads": acc_all})

    def backward(acc, reducing: bool = True, new_grads: bool = fresh, what: str = "") -> None:
        """Each block's backward in one kind of micro-batch; ``acc(i)``: unsharded gradients then held."""
        done = grads_before
        for i in reversed(range(len(blocks))):
            k = blocks[i]
            live = root_act + sum(kept[:i]) + full[k] + work[k]
            buf = unit_buffers(i, reducing, new_grads) + root_gathered(new_grads)
            consider(resident + live + done + acc(i) + buf, f"backward of {k} block {i}{what}",
                     {"activations": live, "buffers": buf, "grads": done, "accum_grads": acc(i)})
            if reducing and (accum == 1 or last) and not cpu_offload:
                done += 4 * unit[k].shard(W)

    def held(units: list[str], root: bool) -> int:
        return 4 * (sum(unit[b].numel for b in units) + (m.root.numel if root else 0))

    # the micro-batch that reduces (the last, or each with "every"); under "last" unit i still holds its
    # unsharded gradients and those of the units before it, the units after it their sharded ones
    backward(lambda i: held(blocks[:i + 1], True) if last else 0)
    if last:                                    # micro-batches before the last: no reduction at all
        backward(lambda i: held(blocks[i + 1:], False), False, True, " (first micro-batch)")
        if accum > 2:
            backward(lambda i: acc_all, False, fresh, " (a middle micro-batch)")
    opt_step = resident + grads + (0 if cpu_offload else 4 * shard)    # foreach AdamW: one shard-sized temp
    consider(opt_step, "optimizer step", {"activations": 0, "buffers": 4 * shard, "grads": grads})
    return {
        "params": params, "grads": grads, "accum_grads": acc_all, "optimizer": optimizer, "ema": ema_b,
        "activations": root_act + sum(kept) + max((full[k] - kept[i] + work[k] for i, k in enumerate(blocks)),
                                                  default=0),
        "encoders": encoders,
        "buffers": max(root_gathered() + max(map(unit_buffers, range(len(blocks))), default=0),
                       max(forward_buffers), opt_step - resident - grads),
        "total": peak, "peak_phase": phase, "at_peak": at_peak, "micro_batch": micro, "grad_accum": accum,
        "host": host, "recomputed": sum(full[k] for k in blocks) - sum(kept)}


def estimate_single_gpu(params, img_tokens: int, txt_tokens: int, micro_batch: int = 1, ac: str = "none") -> int:
    """Peak bytes of one training step of an unsharded DiT (``DiTParams``) on one CUDA GPU, as
    ``bench/gpu_suite.py`` runs it: fp32 params and grads, fused AdamW (state and step scalars on the GPU, no
    temporaries), bf16 autocast whose weight copies are cached for the forward and saved for backward (not
    under AC), and eager activations (per-block torch.compile saves less: this is then an upper bound)."""
    m = inventory(params)
    blocks, full, kept, work = block_activations(m, img_tokens, txt_tokens, micro_batch, ac, True, True)
    numel = {"double": m.double.numel, "single": m.single.numel}
    resident = 12 * m.numel + 4 * m.tensors                       # params, exp_avg, exp_avg_sq, step
    root_act = micro_batch * root_activation_bytes(m, img_tokens, txt_tokens, True)
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
