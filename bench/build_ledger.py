"""The device-memory ledger of building and loading a model: each entry point's build through the factory
(``train.build.build_model``) -- training's policy, DPO's policy and reference, sampling (``sample``, ``eval`` and
``candidates`` share ``load_pipeline``'s build) -- on a base of each precision (bf16, fp8, nf4), with and without a
LoRA, measured against the planner's figure (``parallel.adapter_plan.build_ledger``).

On a GPU the peak is ``torch.cuda.max_memory_allocated`` over the build (less what was allocated before it); on a CPU
it is torch's ``MemTracker`` (every storage a torch op creates under its dispatch mode; not a safetensors file's
mapping nor glibc's heap). ``--width 3072`` is FLUX's (24 heads of 128): one double and one single block, random
weights from a one-step run.

    PYTHONPATH=src python bench/build_ledger.py [--device cuda] [--width 3072] [--out ledger.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from difftrain.cli import main as cli  # noqa: E402
from difftrain.config import from_dict, load_config, preset_path, to_toml  # noqa: E402
from difftrain.models import build_autoencoder, build_text_encoder  # noqa: E402
from difftrain.parallel.adapter_plan import build_ledger  # noqa: E402
from difftrain.train.adapters import check_adapter_config, spec_of_checkpoint  # noqa: E402
from difftrain.train.build import Weights, build_model  # noqa: E402
from difftrain.train.checkpoint import Checkpointer  # noqa: E402

LORA = ["adapter.kind=lora", "adapter.rank=4", "adapter.alpha=4"]
CASES = ([(e, "bf16", False) for e in ("train", "dpo", "dpo-reference", "sample")]
         + [(e, p, True) for e in ("train", "dpo", "sample") for p in ("bf16", "fp8", "nf4")])


def model_sets(width: int, blocks: int = 2) -> list[str]:
    """A shapes-tiny run at ``width`` (heads of 128 from 1024 up, else of 32): the block linears dominate. Random
    weights everywhere (``model.init = 'default'``), as a trained base has them: adaLN-zero's zero rows would stay
    in full precision under fp8 (a row of zeros has no scale), which no real base has."""
    head = 128 if width >= 1024 else 32
    rope = [16, 56, 56] if head == 128 else [8, 12, 12]
    return ["model.hidden=%d" % width, "model.heads=%d" % (width // head), f"model.axes_dims_rope={rope}",
            f"model.double_blocks={blocks // 2}", f"model.single_blocks={blocks - blocks // 2}", "data.image_size=32",
            "train.global_batch=2", "train.threads=1", "train.steps=1", "train.checkpoint_every=0",
            "train.ema_decay=0", "train.sample_every=0", "train.log_every=1", "model.init=default"]


def prepare(root: Path, sets: list[str]) -> dict[str, Path]:
    """A base (one step: its checkpoint is DPO's start and a run to sample, its export a base folder) and a LoRA run
    on it (one step: a checkpoint of adapters alone)."""
    (root / "base.toml").write_text(to_toml(load_config(preset_path("shapes-tiny"), sets)))
    assert cli(["train", str(root / "base.toml"), "--run-dir", str(root / "base"), "--no-progress"]) == 0
    base = root / "base" / "export"
    (root / "lora.toml").write_text(to_toml(load_config(preset_path("shapes-tiny"), sets + LORA + [f"model.init_from={base}"])))
    assert cli(["train", str(root / "lora.toml"), "--run-dir", str(root / "lora"), "--no-progress"]) == 0
    return {"base": base, "init": root / "base", "lora": root / "lora"}


def case(runs: dict[str, Path], sets: list[str], entry: str, precision: str, adapted: bool):
    """(config, role, weights, info, adapter) of ``entry``'s build, as the entry point calls the factory."""
    base_info = Checkpointer.read_info(runs["init"])
    sets = sets + (LORA + [f"adapter.base_precision={precision}"] if adapted else [])
    if entry == "sample":
        info = Checkpointer.read_info(runs["lora"] if adapted else runs["init"])
        data = info["config"]
        data["adapter"]["base_precision"] = precision
        return from_dict(data), "sampler", Weights.checkpoint(info["path"], "model", info), info, \
            spec_of_checkpoint(info) if adapted else None
    if entry == "train":
        cfg = load_config(preset_path("shapes-tiny"), sets + [f"model.init_from={runs['base']}"])
        return cfg, "policy", Weights.base(str(runs["base"])), base_info, check_adapter_config(cfg)
    cfg = load_config(preset_path("shapes-tiny"), sets + [f"dpo.init={runs['init']}", "dpo.pairs=pairs.parquet"]
                      + (["dpo.reference=lora"] if adapted else []))
    role = "reference" if entry == "dpo-reference" else "policy"
    spec = check_adapter_config(cfg, dpo=True) if role == "policy" else None
    return cfg, role, Weights.checkpoint(base_info["path"], "model"), base_info, spec


@contextlib.contextmanager
def full_precision_layers():
    """A list that gets, at each quantization of a base layer during the block, how many of the base's layers to
    quantize are then allocated in full precision (1: read and quantized one at a time; the whole base: allocated
    whole first)."""
    from difftrain.models import base_quant

    choose, quantize = base_quant.base_layers, base_quant.quantize_layer
    chosen, counts, done = [], [], set()

    def choosing(dit, precision):
        chosen[:] = [choose(dit, precision)]
        return chosen[0]

    def counting(layer, precision):
        if chosen and any(layer is m for m in chosen[0].values()):     # (not the device trial's small layer)
            done.add(id(layer))     # allocated, read, not yet quantized: the layers other than those done before
            counts.append(sum(type(m.weight.data) is torch.Tensor and not m.weight.is_meta and
                              (id(m) not in done or m is layer) for m in chosen[0].values()))
        quantize(layer, precision)

    base_quant.base_layers, base_quant.quantize_layer = choosing, counting
    try:
        yield counts
    finally:
        base_quant.base_layers, base_quant.quantize_layer = choose, quantize


def measure(cfg, role: str, weights: Weights, info: dict, adapter, device: torch.device):
    """(peak bytes of the build, the build, full-precision layers at each quantization) on ``device``: the encoders
    are made before it."""
    from difftrain.diffusion.pipeline import amp_dtype

    if adapter is not None and cfg.adapter.base_precision != "bf16":     # the device trial (once a process), before
        from difftrain.models.base_quant import check_base_precision    # the count: it is no part of the build
        check_base_precision(cfg.adapter.base_precision, device)
    ae = build_autoencoder(cfg.autoencoder.kind, cfg.autoencoder.factor)
    text = build_text_encoder(cfg, info["text_encoder"]["vocabulary"], device)
    amp = amp_dtype(cfg.train.precision, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with full_precision_layers() as counts:
            built = build_model(cfg, role, device=device, text_encoder=text, autoencoder=ae, weights=weights,
                                adapter=adapter, amp=amp)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, built, counts
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker, full_precision_layers() as counts:
        built = build_model(cfg, role, device=device, text_encoder=text, autoencoder=ae, weights=weights,
                            adapter=adapter, amp=amp)
    return int(tracker.get_tracker_snapshot("peak")[device]["Total"]), built, counts


def probe(device: torch.device, shape: tuple[int, int] = (512, 128)) -> dict:
    """torchao's conversion scratch, bytes a weight: one layer quantized under the count (its fp32 weight made before
    it)."""
    from difftrain.models.base_quant import check_base_precision, quantize_layer

    out = {}
    for precision in ("fp8", "nf4"):
        check_base_precision(precision, device)
        layer = torch.nn.Linear(shape[1], shape[0], device=device).requires_grad_(False)
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            quantize_layer(layer, precision)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            from torch.distributed._tools.mem_tracker import MemTracker
            tracker = MemTracker()
            with tracker:
                quantize_layer(layer, precision)
            peak = tracker.get_tracker_snapshot("peak")[device]["Total"]
        out[precision] = round(peak / layer.weight.numel(), 2)
    return {"quantize_scratch_bytes_per_weight": out, "shape": list(shape)}


def weight_bytes(cfg, role: str, adapted: bool, device: torch.device) -> float:
    """Bytes of a full-precision weight the build holds: a trained one fp32; a frozen one bf16 on a GPU under bf16
    (a frozen base under autocast, a reference, a sampler), fp32 on a CPU."""
    trained = role == "policy" and not adapted
    return 2.0 if device.type == "cuda" and cfg.train.precision == "bf16" and not trained else 4.0


def run(device: torch.device, width: int, root: Path, blocks: int = 2) -> dict:
    """Every case at ``width`` with ``blocks`` blocks (half double, half single), its runs prepared under ``root``."""
    sets = model_sets(width, blocks) + (["train.precision=bf16"] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    runs = prepare(root, sets)
    rows = {}
    for entry, precision, adapted in CASES:
        cfg, role, weights, info, spec = case(runs, sets, entry, precision, adapted)
        try:
            peak, built, counts = measure(cfg, role, weights, info, spec, device)
        except Exception as e:                          # noqa: BLE001 -- a failing case is a figure too
            rows[f"{entry}-{precision}-{'lora' if adapted else 'none'}"] = {"error": repr(e)[-300:]}
            continue
        ledger = build_ledger(cfg, role, weight_bytes(cfg, role, adapted, device))
        rows[f"{entry}-{precision}-{'lora' if adapted else 'none'}"] = {
            "peak_mb": round(peak / 2 ** 20, 1), "ledger_mb": round(ledger["peak_bytes"] / 2 ** 20, 1),
            "within": peak <= ledger["peak_bytes"], "quantized_layers": len(built.quantized),
            "never_meta": not [n for n, p in built.model.named_parameters() if p.is_meta],
            "max_full_precision_layers": max(counts, default=0),
            "fp32_base_mb": round(ledger["full_precision_base_bytes"] / 2 ** 20, 1)}
        del built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "width": width,
            **probe(device, (4 * width, width)), "cases": rows, "all_within": all(r.get("within") for r in rows.values()), "runs": {k: str(v) for k, v in
                                                                                             runs.items()},
            "wall_s": round(time.perf_counter() - t0, 1)}


def write_pairs(out: Path, size: int) -> Path:
    """Eight preference pairs in the Pick-a-Pic layout (a dark and a light image each), as 'difftrain pairs' writes."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from difftrain.align.pairs import pickapic_pairs

    def jpg(shade: int) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(np.full((size, size, 3), shade, np.uint8)).save(buf, format="JPEG")
        return buf.getvalue()

    captions = ["a red circle", "a blue square", "a green triangle", "a small red square", "a big blue circle",
                "a green circle", "a red triangle", "a blue triangle"]
    n = len(captions)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"caption": captions, "jpg_0": [jpg(20 + 5 * i) for i in range(n)],
                             "jpg_1": [jpg(200 + 5 * i) for i in range(n)], "label_0": [1.0, 0.0] * (n // 2),
                             "model_0": ["m0"] * n, "model_1": ["m1"] * n}), out / "pap.parquet")
    pickapic_pairs(out / "pap.parquet", out / "pairs.parquet", validation=0.0, image_size=size)
    return out / "pairs.parquet"


def steps(device: torch.device, width: int, root: Path, blocks: int = 2) -> dict:
    """A LoRA DPO step and a ``sample`` on an nf4 base, through the CLI: each one's peak
    (``torch.cuda.max_memory_allocated``) over the planner's per-GPU figure for an nf4 base (``adapter_plan``: the
    base, the adapters' state, the activations, the encoders, the CUDA context). On a CPU the commands run and the
    peaks are not measured (None)."""
    from difftrain.parallel.adapter_plan import adapter_plan

    sets = model_sets(width, blocks) + (["train.precision=bf16"] if device.type == "cuda" else [])
    root.mkdir(parents=True, exist_ok=True)
    runs = prepare(root, sets)
    pairs = write_pairs(root / "pairs", 32)
    cfg_path = root / "dpo.toml"
    cfg_path.write_text(to_toml(load_config(preset_path("shapes-tiny"), sets + LORA + [
        "adapter.base_precision=nf4", "dpo.reference=lora", "dpo.lora_export=adapter", "adapter.export=adapter",
        f"dpo.init={runs['init']}", f"dpo.pairs={pairs}", "train.global_batch=2"])))
    cfg = load_config(cfg_path)
    vocabulary = Checkpointer.read_info(runs["init"]).get("text_encoder", {}).get("vocabulary")
    plan = adapter_plan(cfg, 1, 80.0, vocabulary)["precisions"]["nf4"]["total_gb"] * 2 ** 30

    def peak_of(args: list[str]):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        assert cli(args) == 0, args
        return torch.cuda.max_memory_allocated() if device.type == "cuda" else None

    dpo = peak_of(["dpo", str(cfg_path), "--run-dir", str(root / "dpo"), "--no-progress"])
    sample = peak_of(["sample", str(root / "dpo"), "--prompt", "a red circle", "--num-images", "1", "--steps", "2",
                      "--out", str(root / "samples")])
    ratio = (lambda b: None if b is None else round(b / plan, 4))
    return {"dpo_nf4_step_peak_gb": None if dpo is None else round(dpo / 2 ** 30, 3),
            "dpo_nf4_step_peak_over_plan": ratio(dpo), "sample_nf4_peak_over_plan": ratio(sample),
            "nf4_plan_gb": round(plan / 2 ** 30, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--out", default="")
    ap.add_argument("--probe", action="store_true", help="only torchao's conversion scratch of one layer")
    ap.add_argument("--steps", action="store_true", help="also a LoRA DPO step and a sample on an nf4 base")
    args = ap.parse_args()
    if args.probe:
        out = {**probe(torch.device(args.device), (4 * args.width, args.width)), "all_within": True}
    else:
        with tempfile.TemporaryDirectory() as d:
            out = run(torch.device(args.device), args.width, Path(d))
            if args.steps:
                out["steps"] = steps(torch.device(args.device), args.width, Path(d) / "steps")
                within = [v for k, v in out["steps"].items() if k.endswith("over_plan") and v is not None]
                out["all_within"] = out["all_within"] and all(v <= 1.0 for v in within)
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    sys.exit(0 if out["all_within"] and out.get("never_whole", True) else 1)


if __name__ == "__main__":
    main()
