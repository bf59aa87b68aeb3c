"""Typed configuration: one dataclass per section, defaults that make a small CPU run work.

Every field carries its own documentation and, where it matters, its valid range or choices
(``meta(...)``). ``load.py`` validates TOML and ``--set`` values against these declarations,
so an unknown key, a wrong type or an out-of-range value is rejected before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def meta(doc: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
         lt: float | None = None, choices: tuple[Any, ...] | None = None, default: Any = None,
         factory: Any = None):
    """A dataclass field with documentation and validation bounds."""
    md = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=md)
    return field(default=default, metadata=md)


@dataclass
class RunConfig:
    name: str = meta("run name; outputs go to <out_dir>/<name>", default="run")
    out_dir: str = meta("parent directory of run directories", default="runs")
    seed: int = meta("global seed: data order, noise, initialisation", ge=0, default=0)


@dataclass
class ModelConfig:
    in_channels: int = meta("token channels = latent channels x 4 (2x2 patches); 0 = from the autoencoder",
                            ge=0, default=0)
    text_dim: int = meta("width of the text-encoder sequence embedding; 0 = from the text encoder", ge=0,
                         default=0)
    pooled_dim: int = meta("width of the pooled text vector; 0 = from the text encoder", ge=0, default=0)
    hidden: int = meta("transformer width (heads x head_dim)", ge=8, default=128)
    heads: int = meta("attention heads", ge=1, default=4)
    double_blocks: int = meta("double-stream (text/image) blocks", ge=0, default=2)
    single_blocks: int = meta("single-stream blocks", ge=0, default=2)
    mlp_ratio: float = meta("MLP hidden = mlp_ratio x hidden", gt=0, default=4.0)
    axes_dims_rope: list[int] = meta("RoPE dims per axis (index, row, col); sum = head_dim",
                                     factory=lambda: [8, 12, 12])
    rope_theta: float = meta("RoPE base", gt=0, default=10000.0)
    guidance_embed: bool = meta("embed a guidance scale (guidance-distilled models such as FLUX.1-dev)",
                                default=False)
    qkv_bias: bool = meta("bias on q/k/v projections (FLUX: true)", default=True)
    abs_pos_embed: bool = meta("add fixed sin/cos features of (index, row, col) to image tokens (not in FLUX, "
                               "which locates tokens by RoPE alone; helps small models learn placement fast)",
                               default=False)
    positions: str = meta("where image position ids (row, col) start: 'corner' (0 at the top left, as FLUX) or "
                          "'centre' (0 at the image centre, so a place relative to the centre has one code at every "
                          "aspect ratio and size of a bucket: what training over aspect buckets needs from a model "
                          "trained from scratch)", choices=("corner", "centre"), default="corner")
    init: str = meta("parameter initialisation; 'zero-out' zeroes modulation gates and the output head "
                     "(adaLN-zero) so every block starts as identity", choices=("zero-out", "default"),
                     default="zero-out")
    init_from: str = meta("start from pretrained weights: a diffusers FLUX transformer directory (config.json + "
                          "safetensors shards) or a difftrain export; loaded shard by shard into the sharded model "
                          "('' = train from the initialisation)", default="")


@dataclass
class TextConfig:
    kind: str = meta("'words': a small encoder trained with the model over a word vocabulary (shapes world); "
                     "'hf': frozen transformers T5 (sequence) and/or CLIP (pooled) encoders",
                     choices=("words", "hf"), default="words")
    max_tokens: int = meta("text sequence length; longer prompts are truncated with a warning", ge=1,
                           default=16)
    dim: int = meta("embedding width of the 'words' encoder", ge=4, default=128)
    layers: int = meta("transformer layers of the 'words' encoder", ge=0, default=1)
    t5_path: str = meta("local path of a T5 encoder (transformers format); '' = none", default="")
    clip_path: str = meta("local path of a CLIP text model (transformers format); '' = none", default="")
    dtype: str = meta("compute dtype of frozen encoders ('auto' = bf16 where supported)",
                      choices=("auto", "bf16", "fp32"), default="auto")
    padding: str = meta("the text rule of every path (training from the shapes world or the store, dropped captions, "
                        "CFG's unconditional branch, sample, eval): 'masked' = encoders run with their attention "
                        "mask, true-length states stored, text padded to a rung of 8, 16, 32 ... max_tokens and "
                        "masked out of the DiT's attention; 'padded' = every caption padded to max_tokens and "
                        "attended, padding included (as FLUX.1 was trained: use it to fine-tune FLUX)",
                        choices=("masked", "padded"), default="masked")
    precision: str = meta("weights of the frozen T5: 'native' (text.dtype) or 'fp8' (float8 weights of its linear "
                          "layers through torchao, computed in text.dtype; the FFN output projections 'wo', "
                          "embeddings and norms stay in text.dtype, as published FP8 T5 practice keeps them: wo "
                          "reads T5's activation outliers). Recorded in the store's cache key",
                          choices=("native", "fp8"), default="native")


@dataclass
class AutoencoderConfig:
    kind: str = meta("'pixel-unshuffle' (exact, no weights) or 'diffusers' (AutoencoderKL from a local path)",
                     choices=("pixel-unshuffle", "diffusers"), default="pixel-unshuffle")
    factor: int = meta("spatial factor of the pixel-unshuffle autoencoder", ge=1, default=4)
    path: str = meta("local path of a diffusers AutoencoderKL", default="")
    scaling: float = meta("latent = (z - shift) * scaling; 0 = take it from the model config", ge=0,
                          default=0.0)
    shift: float = meta("see scaling", default=0.0)


EDIT_KINDS: tuple[str, ...] = ("color", "position", "shape", "size")   # what a shapes-world edit changes


def edit_kind_weights(weights: dict[str, float] | None) -> dict[str, float] | None:
    """``data.edit_kinds`` as each edit kind's probability of being kept (its weight over the largest), or None for
    equal kinds. Raises ValueError naming the kind or the weights."""
    if not weights:
        return None
    bad = sorted(set(weights) - set(EDIT_KINDS))
    if bad:
        raise ValueError(f"edit_kinds: unknown kind(s) {', '.join(map(repr, bad))}; expected {', '.join(EDIT_KINDS)}")
    full = {k: float(weights.get(k, 1.0)) for k in EDIT_KINDS}
    if any(not (v >= 0.0 and v < float("inf")) for v in full.values()) or max(full.values()) <= 0.0:
        raise ValueError(f"edit_kinds = {weights}: expected finite weights >= 0, at least one > 0")
    top = max(full.values())
    if min(full.values()) == top:
        return None
    if min(v / top for v in full.values() if v > 0) < 0.02:
        raise ValueError(f"edit_kinds = {weights}: the smallest non-zero weight must be at least 1/50 of the largest")
    return {k: v / top for k, v in full.items()}


@dataclass
class DataConfig:
    source: str = meta("what training reads: 'shapes' (the procedural world, rendered on the fly) or 'store' (the "
                       "latent store 'difftrain prepare' wrote, through the curriculum of data.stages)",
                       choices=("shapes", "store"), default="shapes")
    store: str = meta("the latent store: a local path or fsspec URI (written by 'difftrain prepare', read by "
                      "training with data.source = 'store')", default="")
    sources: list[dict] = meta("raw inputs of 'difftrain prepare': [[data.sources]] tables {name, kind = folder | "
                               "manifest | webdataset | edit | keyframes, path, task}", factory=list)
    filters: list[dict] = meta("curation, applied in order: [[data.filters]] tables {kind = size | area | aspect | "
                               "caption | exact_dup | near_dup | score, ...}; near_dup {distance, window = 32}: "
                               "phashes within distance bits, each compared with at most window others per band",
                               factory=list)
    stages: list[dict] = meta("the curriculum: [[data.stages]] tables {name, start_step, buckets = [[h, w], ...] or "
                              "[{size = [h, w], global_batch, micro_batch}], global_batch, micro_cost, cost_power, "
                              "crop = center | random, mixture = {source = weight}}", factory=list)
    encoder_actors: int = meta("'difftrain prepare': autoencoder (and frozen text encoder) actors on the Ray cluster; "
                               "0 = one per GPU, or on a cluster without GPUs half its CPUs (each actor runs torch "
                               "on one thread; the other CPUs decode and write)", ge=0, default=0)
    encoder_device: str = meta("'difftrain prepare': where encoder actors run: 'auto' (one GPU each where the cluster "
                               "has GPUs, else CPUs), 'gpu' (refused on a cluster without GPUs) or 'cpu'",
                               choices=("auto", "gpu", "cpu"), default="auto")
    latent_dtype: str = meta("how latents are kept in the store (bf16 as its raw 16-bit pattern: half the bytes)",
                             choices=("bf16", "fp32"), default="bf16")
    cache_dir: str = meta("node-local cache folder in front of a shared store, shared by the node's processes: "
                          "the Lance fragments the next steps read are copied there, one copy per node ('' = read "
                          "the store directly)", default="")
    cache_gb: float = meta("size limit of the node-local cache: bounds every file in data.cache_dir, copies in "
                           "progress included; the least recently wanted fragments are evicted", gt=0, default=50.0)
    cache_lookahead: int = meta("planned steps ahead of the reads whose Lance fragments the node-local cache copies, "
                                "first needed first (beyond data.prefetch, the steps already being read)", ge=1,
                                default=32)
    prefetch: int = meta("global batches read ahead of the optimizer (per rank)", ge=1, default=4)
    read_threads: int = meta("threads reading and collating store batches", ge=1, default=2)
    max_error_rate: float = meta("fraction of per-sample faults (unreadable images, bad rows) tolerated before a "
                                 "prepare or a training run fails", ge=0, le=1, default=0.01)
    image_size: int = meta("image side in pixels", ge=8, default=48)
    frames: int = meta("frames per keyframe sequence", ge=2, le=16, default=4)
    motion: str = meta("keyframe paths: 'any' start and end cell, or 'across' (the 16 straight paths two cells "
                       "long: with 3 frames every frame sits on a cell centre)", choices=("any", "across"),
                       default="any")
    background: list[int] = meta("[lo, hi]: grey shades of the background (not in captions)",
                                 factory=lambda: [100, 160])
    world_size: int = meta("examples per task in the world (the epoch length)", ge=1, default=50000)
    t2i_weight: float = meta("share of text-to-image batches", ge=0, default=0.5)
    edit_weight: float = meta("share of editing batches", ge=0, default=0.25)
    keyframe_weight: float = meta("share of keyframe batches", ge=0, default=0.25)
    edit_kinds: dict = meta("training weight of each kind of edit: a table {color, position, shape, size} (a kind not "
                            "named weighs 1; {} = all equal). The evaluation draws every kind equally whatever this "
                            "says", factory=dict)
    edit_changed_weight: float = meta("loss weight of an edit's target tokens that differ from its reference frame (what "
                                      "the edit changes: a recoloured shape's token; a move's old and new cell); the "
                                      "other target tokens weigh 1, and the step's loss is divided by the sum of the "
                                      "weights (1 = every target token alike)", ge=1, le=100, default=1.0)
    keyframe_cond_prob: float = meta("probability that a keyframe example gives some frames as clean "
                                     "conditioning (a random non-empty proper subset)", ge=0, le=1,
                                     default=0.5)
    caption_dropout: float = meta("probability of an empty prompt (for classifier-free guidance)", ge=0,
                                  le=1, default=0.1)


@dataclass
class DiffusionConfig:
    timesteps: str = meta("timestep distribution", choices=("uniform", "logit-normal"),
                          default="logit-normal")
    logit_mean: float = meta("mean m of logit-normal(m, s); > 0 favours noisy timesteps", default=0.0)
    logit_std: float = meta("std s of logit-normal(m, s)", gt=0, default=1.0)
    shift: str = meta("timestep shift: 'none', 'fixed' (shift_value) or 'resolution' (FLUX mu from "
                      "the token count)", choices=("none", "fixed", "resolution"), default="none")
    shift_value: float = meta("shift for 'fixed': t' = s t / (1 + (s - 1) t)", gt=0, default=1.0)
    prediction: str = meta("what the network outputs: 'v' (velocity eps - x0, as FLUX) or 'x' (the clean "
                           "sample); both are converted to v for the loss and the sampler", choices=("v", "x"),
                           default="v")
    loss: str = meta("'v': MSE of the velocity (FLUX); 'x': MSE of the implied clean sample x0 = x_t - t v, "
                     "i.e. the v-MSE weighted by t^2, which moves the emphasis to noisy timesteps, where the "
                     "prompt decides the image; 'x/t': the x-MSE over t (the v-MSE weighted by t), between the two",
                     choices=("v", "x", "x/t"), default="v")


@dataclass
class TrainConfig:
    steps: int = meta("optimizer steps", ge=0, default=200)
    minutes: float = meta("stop after this many minutes of training (0 = no limit)", ge=0, default=0.0)
    global_batch: int = meta("samples per optimizer step, summed over all data-parallel ranks (the numerics are "
                             "defined by it: any world size that divides it computes the same step)", ge=1,
                             default=16)
    micro_batch: int = meta("most samples one rank runs in one forward; gradient accumulation = global_batch / "
                            "(data-parallel size x micro_batch) (0 = the rank's whole share, no accumulation)",
                            ge=0, default=0)
    lr: float = meta("peak learning rate", gt=0, default=3e-4)
    min_lr_ratio: float = meta("final LR as a fraction of peak (cosine)", ge=0, le=1, default=0.1)
    warmup_steps: int = meta("linear warmup steps", ge=0, default=20)
    schedule: str = meta("LR schedule after warmup", choices=("cosine", "constant"), default="cosine")
    schedule_change: str = meta("when a resumed run's length differs (train.steps or train.minutes changed): "
                                "'keep_lr' keeps the LR it had at the resume step and re-plans the cosine from there to "
                                "the new end; 'follow' takes the schedule as planned for the new length (the LR jumps to "
                                "its value there). Either way the resume logs both LRs",
                                choices=("keep_lr", "follow"), default="keep_lr")
    optimizer: str = meta("'adamw' for every parameter; 'muon': Muon (momentum orthogonalised by Newton-Schulz, "
                          "scaled to AdamW's update RMS, so the same lr and schedule apply) for the 2-D weights inside "
                          "the transformer blocks and AdamW for the rest (train/muon.py)",
                          choices=("adamw", "muon"), default="adamw")
    muon_momentum: float = meta("Muon's (Nesterov) momentum", ge=0, lt=1, default=0.95)
    muon_ns_steps: int = meta("Newton-Schulz iterations of a Muon update", ge=1, le=20, default=5)
    weight_decay: float = meta("AdamW weight decay (decoupled; Muon's too)", ge=0, default=0.0)
    beta1: float = meta("AdamW beta1", ge=0, lt=1, default=0.9)
    beta2: float = meta("AdamW beta2", ge=0, lt=1, default=0.999)
    grad_clip: float = meta("clip the global gradient norm to this (0 = off)", ge=0, default=1.0)
    ema_decay: float = meta("EMA decay (0 = EMA off; sampling then uses the raw weights)", ge=0, lt=1,
                            default=0.999)
    precision: str = meta("'auto' = bf16 autocast where the device supports it, else fp32",
                          choices=("auto", "bf16", "fp32"), default="auto")
    export_dtype: str = meta("dtype of the end-of-run export (RUN/export/model.safetensors): 'auto' = the compute "
                             "dtype the run trained in (bf16 under bf16 autocast: FLUX.1-dev's 24 GB, not 48 GB in "
                             "fp32), or 'fp32' / 'bf16'", choices=("auto", "bf16", "fp32"), default="auto")
    compile: bool = meta("torch.compile each block", default=False)
    fp8: str = meta("float8 training of the DiT blocks' linear layers (torchao convert_to_float8_training): 'none', "
                    "'tensorwise' or 'rowwise' scaling; embedders, modulation, the final layer and dims not "
                    "multiples of 16 stay in the compute dtype; weights and optimizer state stay high precision "
                    "(checkpoints unchanged). Needs float8 matmuls (CUDA sm89+); emulated on a CPU (tests)",
                    choices=("none", "tensorwise", "rowwise"), default="none")
    compile_cache: str = meta("persistent compile cache directory ('' = RUN/compile_cache, so a restarted job does "
                              "not pay the full compile again; 'off' = torch's default per-user cache)", default="")
    threads: int = meta("CPU threads for torch (0 = torch's default)", ge=0, default=0)
    log_every: int = meta("steps between metric lines", ge=1, default=10)
    sample_every: int = meta("steps between sample grids (0 = only at the end)", ge=0, default=0)
    checkpoint_every: int = meta("steps between checkpoints (0 = only at the end)", ge=0, default=100)
    keep_checkpoints: int = meta("newest complete checkpoints kept on disk (the newest is never deleted)", ge=1,
                                 default=2)
    keep_every: int = meta("also keep every checkpoint whose step is a multiple of this (0 = none)", ge=0, default=0)
    async_checkpoint: bool = meta("write checkpoints in the background: the state is staged to host memory (pinned "
                                  "on GPUs) before the next step, and written while training goes on; the final "
                                  "checkpoint and a preemption's are always written before exiting", default=True)
    checkpoint_timeout: float = meta("minutes a background save's writers may wait for each other (their own gloo "
                                     "group: the gather of every rank's write results waits for the slowest writer on "
                                     "a shared file system, longer than parallel.timeout_minutes allows a step)",
                                     gt=0, le=1440, default=60.0)
    max_failed_saves: int = meta("stop the run, on every rank, once this many checkpoints in a row have failed: a run "
                                 "never trains on for days with nothing to resume from", ge=1, le=1000, default=3)
    metrics_port: int = meta("serve Prometheus metrics on this port (the process of local rank r on port + r, so "
                             "every node serves the same ports; 0 = off)", ge=0, le=65535, default=0)
    peak_tflops: float = meta("dense peak TFLOP/s of one accelerator at the training dtype, for MFU (0 = from the "
                              "device: the spec table, which holds H100/H200/B200/GB200, or a measured GEMM rate "
                              "on CPU); set it for others, e.g. 312 for an A100 in bf16", ge=0, default=0.0)


@dataclass
class ParallelConfig:
    dp_replicate: int = meta("data-parallel replicas (HSDP: replicate across, shard within); -1 = the rest of the "
                             "world", ge=-1, default=1)
    dp_shard: int = meta("FSDP2 shard group size (1 = no sharding: DDP arithmetic); -1 = the rest of the world",
                         ge=-1, default=-1)
    cp: int = meta("context-parallel size (Ulysses all-to-all over heads; must divide model.heads); -1 = the rest",
                   ge=-1, default=1)
    backend: str = meta("process-group backend: 'auto' = NCCL on GPUs, gloo on CPUs; 'gloo' trains on the CPU "
                        "even where GPUs exist", choices=("auto", "nccl", "gloo"), default="auto")
    ac: str = meta("activation checkpointing: 'none', 'full' (every block), 'every:N' (every N-th block) or "
                   "'selective' (keep matmul/attention outputs, recompute the rest); off by default: shard first, "
                   "'difftrain plan' says when it is needed", default="none")
    cpu_offload: bool = meta("keep sharded parameters, gradients and optimizer state in host memory "
                             "(FSDP2 CPUOffloadPolicy)", default=False)
    grad_sync: str = meta("gradient accumulation: 'last' reduces gradients once, after the last micro-batch (least "
                          "communication; every rank holds the whole model's unsharded fp32 gradients meanwhile); "
                          "'every' reduce-scatters after each micro-batch and all-reduces across HSDP replicas only "
                          "after the last (the memory of a step without accumulation)", choices=("last", "every"),
                          default="last")
    timeout_minutes: float = meta("collective timeout after the first steps", gt=0, default=10.0)
    startup_timeout_minutes: float = meta("collective timeout for start-up and the first steps (compilation, "
                                          "checkpoint loading)", gt=0, default=30.0)
    startup_steps: int = meta("steps that run under startup_timeout_minutes", ge=0, default=5)


@dataclass
class AttentionConfig:
    backend: str = meta("the attention kernel: 'sdpa' (PyTorch SDPA's own choice), 'auto' (each shape the run meets "
                        "timed on every eligible backend at start-up, the fastest that matches the math kernel "
                        "runs it: the hybrid), or one backend ('difftrain bench attention' lists them: sdpa-math, "
                        "sdpa-flash, sdpa-efficient, sdpa-cudnn, sdpa-fa3, sdpa-fa4, flex, flash-attn)",
                        default="sdpa")
    cache: str = meta("where 'auto' keeps its timings (JSON, keyed by device, versions and dtype; '' = "
                      "RUN/attention_tune.json; a shared path lets every run on the same GPUs reuse them)", default="")


@dataclass
class SampleConfig:
    steps: int = meta("Euler steps", ge=1, default=20)
    cfg_scale: float = meta("classifier-free guidance scale (1 = off)", ge=0, default=4.0)
    guidance: float = meta("the guidance scale fed to the guidance embedding of a guidance-distilled model "
                           "(model.guidance_embed: FLUX.1-dev is sampled at 3.5); other models have no such input "
                           "and ignore it", gt=0, le=100, default=1.0)
    shift: str = meta("sampling schedule shift ('train' = same as diffusion.shift; 'resolution' = FLUX's mu from the "
                      "image token count)",
                      choices=("train", "none", "fixed", "resolution"), default="train")
    shift_value: float = meta("shift for 'fixed'", gt=0, default=1.0)
    seed: int = meta("sampling seed", ge=0, default=0)
    prompts: str = meta("a text file of prompts, one a line, for the preview grids of train.sample_every ('' = "
                        "the run's own: the shapes world's tasks, or captions of the store's text-to-image tables)",
                        default="")


@dataclass
class PreviewConfig:
    count: int = meta("prompts a preview grid holds (the shapes world: examples of each task); each row shows the base "
                      "(a fine-tune's), the current weights and the EMA side by side", ge=1, le=16, default=4)
    width: int = meta("preview width in pixels (0 = data.image_size, at most 1024)", ge=0, le=4096, default=0)
    height: int = meta("preview height in pixels (0 = data.image_size, at most 1024)", ge=0, le=4096, default=0)
    prompts: list[dict] = meta("previews of your own: tables {prompt = '...', width = W, height = H, seed = S, "
                               "guidance = G}, all but prompt optional (default preview.width/height, sample.seed, "
                               "sample.guidance); the first preview.count are drawn. Empty: sample.prompts' file, else "
                               "the run's own captions", factory=list)
    text: str = meta("how previews encode their prompts: 'auto' (a store-fed run with frozen encoders previews its "
                     "store's own captions from the states the store holds: T5 and CLIP are never built; any other "
                     "run encodes) or 'encoders' (build the text encoders for previews, as prompts the store does "
                     "not hold need)", choices=("auto", "encoders"), default="auto")


PREVIEW_KEYS = {"prompt": str, "width": int, "height": int, "seed": int, "guidance": float}


@dataclass
class EvalConfig:
    n: int = meta("prompts per task", ge=1, default=64)
    seed: int = meta("seed of the evaluation prompts and images (a world seed other than training's)", ge=0,
                     default=12345)
    keyframe_given: str = meta("which keyframes are given as conditioning at evaluation: 'none' or 'first'",
                               choices=("none", "first"), default="first")


@dataclass
class ValidationConfig:
    every: int = meta("steps between evaluations of the flow-matching validation loss (0 = off); each is logged as "
                      "val_loss (and val_loss_ema), per timestep as val_loss_t<k>, in metrics.jsonl, TensorBoard and "
                      "the report", ge=0, default=0)
    n: int = meta("held-out samples per task (shapes) or per table of the stage in force (store), the same at "
                  "every evaluation", ge=1, le=4096, default=32)
    timesteps: int = meta("points of the fixed timestep grid, t = (k + 0.5) / timesteps: each sample is judged at "
                          "every point with noise fixed by (validation.seed, sample id, k), so two evaluations differ "
                          "only by the weights", ge=1, le=64, default=8)
    seed: int = meta("seed of the fixed noise", ge=0, default=0)
    source: str = meta("the held-out split. Store: the name of a [[data.sources]] entry left out of training (its "
                       "rows are the validation set; required with data.source = 'store'). Shapes: '' = the "
                       "evaluation world (eval.seed), never trained on", default="")
    ema: bool = meta("also evaluate the EMA weights (when train.ema_decay > 0)", default=True)


@dataclass
class HealthConfig:
    rollback_after: int = meta("a step with a non-finite loss or gradient is skipped (no update) and counted; after "
                               "this many in a row, roll back to the newest complete checkpoint and skip the "
                               "offending batches on replay (0 = fail at the first non-finite step instead)", ge=0,
                               default=3)
    max_rollbacks: int = meta("rollbacks in one run before it fails", ge=0, default=3)
    rollback_lr_factor: float = meta("multiply the LR by this after each rollback (1 = unchanged)", gt=0, le=1,
                                     default=1.0)
    spike_window: int = meta("losses (of the same task) in the window of the loss-spike detector", ge=5, default=200)
    spike_z: float = meta("robust z-score (median/MAD over the window) above which a loss is logged as a spike "
                          "with the batch's sample ids (0 = off)", ge=0, default=8.0)
    hang_seconds: float = meta("a rank with no progress for this long dumps every thread's stack to RUN/hang/ and "
                               "exits non-zero, so that the launcher restarts the job (0 = no watchdog)", ge=0,
                               default=900.0)
    hang_startup_seconds: float = meta("the watchdog's allowance before the first step (building, loading, "
                                       "compiling)", gt=0, default=3600.0)
    preempt_exit_code: int = meta("exit status of every rank after stopping for SIGTERM/SIGUSR1 (checkpoint written, "
                                  "RUN/requeue.json left): 0 suits a launcher script that reads the marker (SLURM); "
                                  "non-zero makes torchrun and Kubernetes restart the workers, where a pod that "
                                  "exits 0 counts as done", ge=0, le=255, default=0)
    preempt_lead_s: float = meta("seconds the scheduler gives between its preemption signal and its kill (SLURM "
                                 "--signal=SIG@N: N; Kubernetes: terminationGracePeriodSeconds); after each "
                                 "checkpoint the run records what it needs in RUN/preemption.json and warns when "
                                 "this is shorter (0 = not checked)", ge=0, default=0.0)
    straggler_every: int = meta("steps between gathers of the ranks' step times (0 = off)", ge=0, default=50)
    straggler_factor: float = meta("a rank whose busy time exceeds this x the median is reported as a straggler",
                                   gt=1, default=1.5)


@dataclass
class DPOConfig:
    init: str = meta("the checkpoint DPO starts from (a checkpoint directory or a run directory: its newest); the "
                     "reference is the same weights, frozen", default="")
    use_ema: bool = meta("start from the checkpoint's EMA weights when it has them (what sample and eval use)",
                         default=True)
    pairs: str = meta("the preference pairs file 'difftrain pairs' wrote (Parquet); its images are encoded once, "
                      "into PAIRS.encoded/, before the first step", default="")
    beta: float = meta("beta of softplus(beta / 2 x delta), delta the winner's minus the loser's policy-minus-"
                       "reference error, each the mean over the sample's loss tokens (with that reduction flow "
                       "recipes use 100-2000)", gt=0, default=2000.0)
    sft_weight: float = meta("weight of an added flow-matching term on the winners (0 = off)", ge=0, default=0.0)
    replay_weight: float = meta("weight of an added flow-matching term on the base's own kind of training data (the "
                                "config's data section; the shapes source only): one replay sample a pair, drawn as "
                                "pretraining draws them (its task mixture, curriculum and seed), each weighed as a "
                                "winner is by sft_weight, so what the preference does not ask about is held where the "
                                "base had it (0 = off)", ge=0, default=0.0)
    reference: str = meta("'copy': a frozen copy of the starting weights, sharded like the policy (bf16 on GPUs, no "
                          "optimizer state, no EMA); 'lora': LoRA adapters (peft) on the DiT are trained and the "
                          "reference is the DiT with its adapters disabled", choices=("copy", "lora"),
                          default="copy")
    lora_rank: int = meta("LoRA rank (reference = 'lora')", ge=1, default=16)
    lora_alpha: float = meta("LoRA alpha (scale alpha / rank)", gt=0, default=16.0)
    lora_targets: list[str] = meta("the DiT's linear layers LoRA adapts, by name suffix",
                                   factory=lambda: ["qkv", "proj", "linear1", "linear2", "img_mlp.0", "img_mlp.2",
                                                    "txt_mlp.0", "txt_mlp.2"])
    lora_export: str = meta("what the end-of-run export holds with LoRA: 'merge' (the adapted weights, a plain "
                            "model) or 'adapter' (the base and the adapter apart)", choices=("merge", "adapter"),
                            default="merge")
    validation_every: int = meta("steps between validation passes over the pairs file's validation split "
                                 "(implicit accuracy; 0 = off)", ge=0, default=0)
    patience: int = meta("stop once validation implicit accuracy has not improved for this many passes (0 = never "
                         "stop early)", ge=0, default=0)


ADAPTER_TARGETS = ["qkv", "proj", "linear1", "linear2", "img_mlp.0", "img_mlp.2", "txt_mlp.0", "txt_mlp.2"]


@dataclass
class AdapterConfig:
    kind: str = meta("'none': every DiT weight is trained (a full fine-tune, or pretraining); 'lora' or 'lokr' "
                     "(peft): adapters on the DiT's target layers are trained, the base DiT and the text encoder are "
                     "frozen, and checkpoints hold the adapters, their optimizer state and the base's digest",
                     choices=("none", "lora", "lokr"), default="none")
    rank: int = meta("adapter rank (LoRA: A is rank x in, B out x rank; LoKr: the rank of its factors)", ge=1,
                     le=4096, default=16)
    alpha: float = meta("adapter alpha: the update is scaled by alpha / rank", gt=0, default=16.0)
    targets: list[str] = meta("the DiT's linear layers adapted, by name or name suffix ('qkv' adapts every "
                              "attention's fused q/k/v projection)", factory=lambda: list(ADAPTER_TARGETS))
    dropout: float = meta("dropout on the adapter's input (LoRA) or on whole adapter modules (LoKr); each rank draws "
                          "from its own stream, seeded by (run.seed, step, rank, micro-batch), so a resume draws the "
                          "same masks and ranks draw different ones; a run with dropout is not the same on every "
                          "world size", ge=0, lt=1, default=0.0)
    export: str = meta("what the end-of-run export holds: 'adapter' (RUN/export/adapter/: the adapter's tensors and "
                       "adapter_config.json; the base beside it unless it is model.init_from, which the user has) or "
                       "'merge' (a plain model, every adapter folded into its layer)", choices=("adapter", "merge"),
                       default="adapter")
    base_precision: str = meta("how the frozen base's block linears are held: 'bf16' unquantized (in the run's "
                               "weights' dtype: fp32 with bf16 compute on a GPU, fp32 on a CPU); 'fp8' (float8 e4m3, "
                               "one scale a row) or 'nf4' (4-bit NormalFloat, blocks of 64; QLoRA's) weight-only "
                               "through torchao, not sharded by FSDP; the adapters in full precision",
                               choices=("bf16", "fp8", "nf4"), default="bf16")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    text: TextConfig = field(default_factory=TextConfig)
    autoencoder: AutoencoderConfig = field(default_factory=AutoencoderConfig)
    data: DataConfig = field(default_factory=DataConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    preview: PreviewConfig = field(default_factory=PreviewConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
