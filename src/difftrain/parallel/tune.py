"""The attention autotuner: for every attention shape a run will meet, time each eligible backend once and keep
the fastest that computes what the math kernel computes: the hybrid.

Shapes (``attention_shapes``): per task (and, for a store-fed curriculum, per stage and bucket) the image tokens,
plus every text length the text rule pads to (``masked``: each rung of the ladder up to ``text.max_tokens``;
``padded``: ``max_tokens``), at the run's micro-batch, with context parallelism's heads per rank.

A backend may win a shape only after matching ``sdpa-math`` on it within ``TOLERANCE`` of its dtype (the largest
error of the output and, for training, of the three input gradients, relative to the reference's largest
magnitude; the reference runs in float32). Then forward (and backward, for training) is timed: ``warmup`` runs,
then the median of ``reps``.

The winners are cached as JSON (``attention.cache``; default ``RUN/attention_tune.json``) under a key of the
device's name and capability, the torch and flash-attn versions, the dtype and training or not; a cache with
another key is ignored with a warning and tuned again.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch

from difftrain.config import Config
from difftrain.models.kernels import BACKENDS, DTYPE_NAMES, MATH, Shape
from difftrain.models.text import MIN_RUNG

log = logging.getLogger("difftrain")

TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 5e-3}
FORMAT = "difftrain-attention-tune-1"


def text_lengths(cfg: Config) -> list[int]:
    if cfg.text.padding == "padded":
        return [cfg.text.max_tokens]
    out, rung = [], MIN_RUNG
    while rung < cfg.text.max_tokens:
        out.append(rung)
        rung *= 2
    return out + [cfg.text.max_tokens]


def micro_batches(share: int, micro: int) -> set[int]:
    """The micro-batch sizes a rank's ``share`` of a bucket is cut into when each holds at most ``micro``: as
    the store loader cuts it (``ceil(share / micro)`` parts, as even as they can be)."""
    n = -(-share // max(1, micro))
    return {(share * (j + 1)) // n - (share * j) // n for j in range(n)}


def attention_shapes(cfg: Config, micro_batch: int, dtype: str = "fp32", cp: int = 1,
                     batch_factor: int = 1, dp_size: int = 1) -> list[Shape]:
    """Every (batch, heads, length, head dim) the DiT's attention meets in this run (``batch_factor`` 2 for DPO's
    winners and losers). ``micro_batch`` 0: the store's per-bucket batches, each bucket's share of this rank
    (``global_batch / dp_size``) cut into cost-balanced micro-batches (``Bucket.micro_for``), each shape at the
    sizes its bucket gives."""
    from difftrain.parallel.memory import bucket_shapes, task_shapes

    buckets = bucket_shapes(cfg)
    if micro_batch > 0 or not buckets:
        image = {(n, max(1, micro_batch)) for _, n, _, _, _ in buckets} or {
            (n, max(1, micro_batch)) for n, _, _ in task_shapes(cfg).values()}
    else:
        image = set()
        for _, n, _, bucket, frames in buckets:
            share = max(1, bucket.global_batch // dp_size)
            image |= {(n, b) for b in micro_batches(share, bucket.micro_for(frames, share))}
    H, D = cfg.model.heads // cp, cfg.model.hidden // cfg.model.heads
    masked = cfg.text.padding == "masked"
    return sorted({Shape(b * batch_factor, H, n + t, D, dtype, masked) for n, b in image
                   for t in text_lengths(cfg)}, key=lambda s: (s.length, s.batch))


def _inputs(shape: Shape, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[shape.dtype]
    q, k, v = (torch.randn(shape.batch, shape.heads, shape.length, shape.head_dim, generator=g).to(device, dt)
               for _ in range(3))
    mask = None
    if shape.masked:            # a ragged key mask: some keys of every row but the first padded out
        keep = torch.ones(shape.batch, shape.length, dtype=torch.bool)
        for b in range(1, shape.batch):
            keep[b, shape.length - (b * 3) % max(1, shape.length // 4) - 1:] = False
        mask = keep[:, None, None, :].to(device)
    return q, k, v, mask


def _run(name: str, q, k, v, mask, training: bool):
    run = BACKENDS[name].run
    if not training:
        with torch.no_grad():
            return run(q, k, v, mask), None
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    out = run(q, k, v, mask)
    out.backward(torch.ones_like(out))
    return out.detach(), (q.grad, k.grad, v.grad)


def verify(name: str, shape: Shape, device: torch.device, training: bool) -> tuple[bool, float]:
    """Whether ``name`` matches the math kernel (in float32) on ``shape``; its largest relative error."""
    q, k, v, mask = _inputs(shape, device)
    out, grads = _run(name, q, k, v, mask, training)
    ref, ref_grads = _run(MATH, q.float(), k.float(), v.float(), mask, training)
    pairs = [(out, ref)] + (list(zip(grads, ref_grads)) if training else [])
    err = max(float((a.float() - b).abs().max() / b.abs().max().clamp(min=1e-6)) for a, b in pairs)
    return err <= TOLERANCE[shape.dtype], err


def time_backend(name: str, shape: Shape, device: torch.device, training: bool, reps: int = 5,
                 warmup: int = 2) -> float:
    """Median milliseconds of one forward (and backward) of ``name`` on ``shape``."""
    q, k, v, mask = _inputs(shape, device, seed=1)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + reps):
        sync()
        t = time.perf_counter()
        _run(name, q, k, v, mask, training)
        sync()
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def cache_key(device: torch.device, dtype: str, training: bool) -> dict:
    import importlib.metadata as md

    try:
        flash = md.version("flash-attn")
    except md.PackageNotFoundError:
        flash = None
    if device.type == "cuda":
        name, cap = torch.cuda.get_device_name(device), list(torch.cuda.get_device_capability(device))
    else:
        import platform
        name, cap = f"cpu:{platform.processor() or platform.machine()}:{torch.get_num_threads()}t", None
    return {"device": name, "capability": cap, "torch": torch.__version__, "flash_attn": flash, "dtype": dtype,
            "training": training}


def load_cache(path: str | Path, key: dict) -> dict:
    """The cached shapes of ``key`` at ``path``; {} when there is none, and, with a warning, when it was tuned
    under another key (another device, version or dtype: tuned again)."""
    p = Path(path)
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        log.warning("attention.cache %s is not JSON: ignored, tuning again", p)
        return {}
    if data.get("format") != FORMAT or data.get("key") != key:
        diff = {k: (data.get("key", {}).get(k), v) for k, v in key.items() if data.get("key", {}).get(k) != v}
        log.warning("attention.cache %s was tuned for another setup (%s): ignored, tuning again", p,
                    ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items()) or "another format")
        return {}
    return data.get("shapes", {})


def tune(shapes: list[Shape], device: torch.device, training: bool, cache: str | Path | None = None,
         backends: list[str] | None = None, reps: int = 5, cp: int = 1) -> dict[str, dict]:
    """{shape key: {"winner", "batches", "ms": {backend: ms}, "rejected": {backend: why}}} for every shape key,
    from the cache where it holds the key at the same batch sizes; new results are written back (a temporary file
    renamed). A key (what the dispatch tells apart: heads, length, head dim, dtype, mask) that the run meets at
    several micro-batch sizes (a store's buckets are cut into cost-balanced micro-batches) is timed at each, and
    a backend's ms is their sum: the winner is the fastest over what the run will do."""
    dtype = shapes[0].dtype if shapes else "fp32"
    key = cache_key(device, dtype, training)
    known = load_cache(cache, key) if cache else {}
    groups: dict[str, list[Shape]] = {}
    for shape in shapes:
        groups.setdefault(shape.key, []).append(shape)
    out = {}
    for skey, group in groups.items():
        group = sorted(set(group), key=lambda s: s.batch)
        batches = [s.batch for s in group]
        if skey in known and known[skey].get("batches", [1]) == batches:
            out[skey] = known[skey]
            continue
        ms, rejected = {}, {}
        for name in backends or list(BACKENDS):
            why = next((w for w in (BACKENDS[name].check(s, device, training, cp) for s in group) if w), None)
            if why is None:
                try:
                    ok, err = verify(name, group[-1], device, training)
                    why = None if ok else f"differs from {MATH} by {err:.2e} > {TOLERANCE[group[-1].dtype]:.0e}"
                    if ok:
                        ms[name] = round(sum(time_backend(name, s, device, training, reps) for s in group), 4)
                except Exception as e:  # noqa: BLE001 - a kernel refusing a shape at run time is a result
                    why = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            if why is not None:
                rejected[name] = why
        if not ms:
            raise RuntimeError(f"no attention backend can run {skey} (batches {batches}): {rejected}")
        out[skey] = {"winner": min(ms, key=ms.get), "batches": batches, "ms": ms, "rejected": rejected}
        log.info("attention %s at batch %s: %s (%s)", skey, batches, out[skey]["winner"],
                 ", ".join(f"{n} {t:.3f} ms" for n, t in sorted(ms.items(), key=lambda x: x[1])))
    if cache:
        p = Path(cache)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "key": key, "shapes": {**known, **out}}, indent=1))
        tmp.replace(p)
    return out


def dispatch_counts(table: dict[str, str], shapes: list[Shape], calls_each: int) -> tuple[int, int, set[str]]:
    """(calls on a tuned kernel, calls on the fallback, the keys not tuned) for forwards on ``shapes``, each
    ``calls_each`` attention calls (one a block): what ``HybridKernel`` dispatches, counted outside the model, so
    that a compiled model's calls are counted too."""
    tuned = fallback = 0
    missing = set()
    for s in shapes:
        if s.key in table:
            tuned += calls_each
        else:
            fallback += calls_each
            missing.add(s.key)
    return tuned, fallback, missing


def summary(results: dict[str, dict]) -> dict:
    """The hybrid against every single backend: total ms over the shapes (each shape once)."""
    names = sorted({n for r in results.values() for n in r["ms"]})
    hybrid = sum(r["ms"][r["winner"]] for r in results.values())
    single = {n: sum(r["ms"][n] for r in results.values()) for n in names
              if all(n in r["ms"] for r in results.values())}
    best = min(single, key=single.get) if single else None
    return {"hybrid_ms": round(hybrid, 3), "single_ms": {n: round(v, 3) for n, v in single.items()},
            "best_single": best,
            "hybrid_speedup_over_best_single": round(single[best] / hybrid, 3) if best else None,
            "hybrid_speedup_over_sdpa": round(single["sdpa"] / hybrid, 3) if "sdpa" in single else None}


def dtype_name(dtype: torch.dtype | None) -> str:
    return DTYPE_NAMES.get(dtype, "fp32") if dtype is not None else "fp32"


def install(cfg: Config, model, device: torch.device, amp: torch.dtype | None, training: bool, micro_batch: int,
            cp: int = 1, run_dir: str | Path | None = None, batch_factor: int = 1, dp_size: int = 1) -> dict:
    """Give the model's attention the kernel ``attention.backend`` names, checked against every shape the run
    meets (a backend that cannot run one is refused, naming the shape and the backends that can); 'auto' tunes
    (rank 0, its table broadcast: every rank runs the same kernels) and installs the hybrid. What was installed."""
    import torch.distributed as dist

    from difftrain.models.attention import set_kernel
    from difftrain.models.kernels import HybridKernel, require

    name = cfg.attention.backend
    shapes = attention_shapes(cfg, micro_batch, dtype_name(amp), cp, batch_factor, dp_size)
    if name != "auto":
        b = require(name, shapes, device, training, cp)
        if name != "sdpa":
            set_kernel(model, b.run)
        return {"backend": name}
    table = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        cache = cfg.attention.cache or (str(Path(run_dir) / "attention_tune.json") if run_dir else None)
        results = tune(shapes, device, training, cache, cp=cp)
        table = {k: r["winner"] for k, r in results.items()}
    if dist.is_initialized():
        box = [table]
        dist.broadcast_object_list(box, src=0)
        table = box[0]
    kernel = HybridKernel(table)
    set_kernel(model, kernel)
    return {"backend": "auto", "table": table, "kernel": kernel}
