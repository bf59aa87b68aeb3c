"""``difftrain`` verbs on a checkpoint or a run: ``export``, ``report``, ``sample`` and ``eval``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from difftrain.errors import UserError, check_positive


def _quant_arg(p) -> None:
    p.add_argument("--quant", choices=("fp8", "mxfp8", "nvfp4"), default=None,
                   help="quantize the DiT's block linears for inference through torchao (bf16 around them); "
                        "emulated in bf16 where the hardware lacks the format, and labelled so (docs/kernels.md)")


def add_parsers(sub) -> None:
    p = sub.add_parser("export", help="consolidated safetensors weights (EMA or raw) and config from a checkpoint",
                       description="Write a checkpoint's weights as one safetensors file with its config, from "
                                   "any number of shards; or a diffusers FluxTransformer2DModel folder.")
    p.add_argument("checkpoint", help="checkpoint directory, RUN/checkpoints/latest, or a run directory")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--weights", choices=("auto", "ema", "raw"), default="auto",
                   help="the EMA weights or the raw ones (default auto: the EMA where the run kept one, else raw)")
    p.add_argument("--layout", choices=("difftrain", "diffusers"), default="difftrain",
                   help="difftrain: model.safetensors + config.toml; diffusers: transformer/ in diffusers' layout")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                   help="dtype of the written tensors (default: the dtype the run computed in: bf16 under bf16 "
                        "autocast, as FLUX.1-dev is distributed)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--quant", choices=("fp8", "mxfp8", "nvfp4"), default=None,
                   help="write the linears sample --quant quantizes in that format, with their scales (difftrain "
                        "layout; for serving: model.init_from refuses it)")
    p.add_argument("--adapter", action="store_true",
                   help="a run with an adapter (adapter.kind lora/lokr): write the adapter alone in diffusers' LoRA "
                        "format for FLUX (OUT/pytorch_lora_weights.safetensors; load_lora_adapter / "
                        "load_lora_weights load it)")

    p = sub.add_parser("report", help="an HTML page and a PNG of a run's loss, throughput, MFU, data wait, "
                                      "checkpoint stalls, restarts and skipped steps, with its latest samples")
    p.add_argument("run_dir", help="run directory")
    p.add_argument("--out", default=None, help="output directory (default RUN/report)")

    p = sub.add_parser("sample", help="generate images from a checkpoint",
                       description="Generate PNGs from a checkpoint for one prompt.")
    p.add_argument("checkpoint", help="checkpoint directory, RUN/checkpoints/latest, or a run directory")
    p.add_argument("--prompt", required=True, help="the caption (or the edit instruction with --edit)")
    p.add_argument("--edit", metavar="IMAGE", default=None, help="edit this image (reference at RoPE index 1)")
    p.add_argument("--frames", type=int, default=None, metavar="K", help="generate K keyframes (K >= 1)")
    p.add_argument("--num-images", type=int, default=4, help="samples to draw (default 4)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's sample.seed)")
    p.add_argument("--steps", type=int, default=None, help="Euler steps (default: sample.steps)")
    p.add_argument("--cfg-scale", type=float, default=None, help="guidance scale (default: sample.cfg_scale)")
    _guidance_arg(p)
    p.add_argument("--out", default=None, help="output directory (default: RUN/samples/cli)")
    p.add_argument("--raw-weights", action="store_true", help="use the raw weights instead of the EMA")
    _quant_arg(p)
    adapter_args(p)

    p = sub.add_parser("eval", help="evaluate a checkpoint on the shapes world",
                       description="Generate for N prompts per task and read them back with the shapes evaluator.")
    p.add_argument("checkpoint", help="checkpoint directory, RUN/checkpoints/latest, or a run directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--n", type=int, default=None, help="prompts per task (default: eval.n)")
    p.add_argument("--steps", type=int, default=None, help="Euler steps (default: sample.steps)")
    p.add_argument("--cfg-scale", type=float, default=None, help="guidance scale (default: sample.cfg_scale)")
    _guidance_arg(p)
    p.add_argument("--seed", type=int, default=None,
                   help="draw another prompt set and other noise (default: eval.seed and sample.seed)")
    p.add_argument("--grid", default=None, help="also write a PNG grid of the generated samples here")
    _quant_arg(p)
    adapter_args(p)


def adapter_args(p) -> None:
    p.add_argument("--adapter", action="append", metavar="PATH", default=None,
                   help="fold in an adapter: an adapter run (its run or checkpoint directory) or its export/adapter "
                        "folder; repeat for several")
    p.add_argument("--adapter-scale", action="append", type=float, metavar="S", default=None,
                   help="strength of the adapters (one for all, or one per --adapter; default 1; within [-10, 10])")


def _guidance_arg(p) -> None:
    p.add_argument("--guidance", type=float, default=None,
                   help="embedded guidance of a guidance-distilled model (default: sample.guidance; FLUX.1-dev 3.5)")


def cmd_export(args) -> int:
    from difftrain.export import export_checkpoint

    if args.adapter:
        if args.layout != "difftrain" or args.quant or args.dtype != "auto":
            raise UserError("export --adapter writes diffusers' LoRA format in fp32: --layout, --quant and --dtype "
                            "do not apply")
        from difftrain.adapter_export import export_adapter
        print(json.dumps(export_adapter(args.checkpoint, args.out, weights=args.weights, overwrite=args.overwrite)))
        return 0
    print(json.dumps(export_checkpoint(args.checkpoint, args.out, weights=args.weights, layout=args.layout,
                                       dtype=args.dtype, overwrite=args.overwrite, quant=args.quant)))
    return 0


def cmd_report(args) -> int:
    from difftrain.report import write_report

    print(json.dumps(write_report(args.run_dir, args.out)))
    return 0


def cmd_sample(args) -> int:
    check_positive("--num-images", args.num_images)
    check_positive("--steps", args.steps)
    if args.frames is not None and args.frames < 1:
        raise UserError(f"--frames {args.frames}: expected a number of keyframes >= 1")
    from difftrain.images import caption_grid, read_image, write_png
    from difftrain.inference import guidance_scale, load_pipeline, request_batch

    from difftrain.adapter_export import parse_adapter_args
    pipe, cfg, info = load_pipeline(args.checkpoint, use_ema=not args.raw_weights, quant=args.quant,
                                    guidance=args.guidance, adapters=parse_adapter_args(args.adapter, args.adapter_scale))
    edit = read_image(args.edit, cfg.data.image_size) if args.edit else None
    batch = request_batch(pipe, cfg, [args.prompt] * args.num_images, edit, args.frames)
    seed = cfg.sample.seed if args.seed is None else args.seed
    from difftrain.parallel.dist import gather_objects, rank_world

    # Under torchrun each rank generates its slice of the images (the model sharded; every forward collective, so
    # a rank with no image generates a stand-in), with the noise each image gets in one process; rank 0 writes.
    rank, ranks = rank_world()
    B = len(batch)
    lo, hi = rank * B // ranks, (rank + 1) * B // ranks
    rows = slice(lo, hi) if hi > lo else slice(0, 1)
    lat = pipe.sample(batch, args.steps or cfg.sample.steps, guidance_scale(cfg, args.cfg_scale), seed=seed,
                      rows=rows if ranks > 1 else None)
    imgs = pipe.to_images(lat)[: hi - lo]
    if ranks > 1:
        import numpy as np
        imgs = np.concatenate(gather_objects(imgs))
        if rank != 0:
            return 0
    out = Path(args.out) if args.out else Path(info["path"]).parent.parent / "samples" / "cli"
    written = []
    for b in range(imgs.shape[0]):
        for f in range(imgs.shape[1] if args.frames else 1):
            name = f"sample_{seed}_{b}" + (f"_frame{f}" if args.frames else "") + ".png"
            written.append(str(write_png(imgs[b, f], out / name)))
    rows = [(([edit] if edit is not None else []) + list(imgs[b, : (imgs.shape[1] if args.frames else 1)]),
             args.prompt) for b in range(imgs.shape[0])]
    grid = caption_grid(rows, out / f"grid_{seed}.png")
    print(json.dumps({"images": written, "grid": str(grid), **({"quant": info["quant"]} if args.quant else {}),
                      **({"adapters": info["adapters"]} if "adapters" in info else {})}))
    return 0


def cmd_eval(args) -> int:
    check_positive("--n", args.n)
    check_positive("--steps", args.steps)
    from difftrain.evaluate import EVAL_KEYS, eval_buckets, evaluate_buckets
    from difftrain.images import caption_grid
    from difftrain.inference import guidance_scale, load_pipeline

    from difftrain.adapter_export import parse_adapter_args
    pipe, cfg, info = load_pipeline(args.checkpoint, quant=args.quant, guidance=args.guidance,
                                    adapters=parse_adapter_args(args.adapter, args.adapter_scale))
    world_seed, noise_seed = (cfg.eval.seed, cfg.sample.seed) if args.seed is None else (args.seed, args.seed)
    from difftrain.parallel.dist import rank_world
    buckets = [name for name, _, _ in eval_buckets(cfg)]
    if rank_world()[0] == 0:
        print(f"evaluating at {len(buckets)} bucket(s) of the last stage: {', '.join(buckets)}"
              + (" (accuracies: their mean; per bucket under by_bucket)" if len(buckets) > 1 else ""), file=sys.stderr)
    metrics, gens = evaluate_buckets(pipe, cfg, world_seed, args.n or cfg.eval.n, args.steps or cfg.sample.steps,
                                     guidance_scale(cfg, args.cfg_scale), noise_seed)
    if rank_world()[0] != 0:                      # under torchrun every rank has the metrics; rank 0 reports
        return 0
    if args.grid:
        caption_grid([(g.images, g.prompt) for g in gens[:: max(1, len(gens) // 24)]], args.grid)
    if args.json:
        import hashlib

        import numpy as np

        # what was evaluated: the checkpoint, the prompts and noise (the same for any checkpoint given the same
        # seeds), and a digest of every generated image (differs as soon as the weights differ)
        prompts = hashlib.sha256("\n".join(g.prompt for g in gens).encode()).hexdigest()
        pixels = hashlib.sha256()
        for g in gens:
            for im in g.images:
                pixels.update(np.ascontiguousarray(im).tobytes())
        print(json.dumps({**{k: metrics[k] for k in EVAL_KEYS}, "stage": metrics["stage"],
                          **({"quant": info["quant"]} if args.quant else {}),
                          **({"adapters": info["adapters"]} if "adapters" in info else {}),
                          "checkpoint": str(info["path"]), "step": int(info["step"]),
                          "seeds": [world_seed, noise_seed], "prompts_sha256": prompts,
                          "images_sha256": pixels.hexdigest(),
                          "buckets": metrics["buckets"],
                          "by_bucket": {b: {k: m[k] for k in EVAL_KEYS} for b, m in metrics["by_bucket"].items()}}))
    else:
        if args.quant:
            q = info["quant"]
            print(f"{'quant':18s} {q['format']} ({q['mode']}, {q['layers']} layers)")
        for k, v in metrics.items():
            if k != "by_bucket":
                print(f"{k:18s} {v}")
        if len(buckets) > 1:
            for b, m in metrics["by_bucket"].items():
                print(f"{b:18s} " + " ".join(f"{k}={m[k]}" for k in ("t2i_color_acc", "t2i_position_acc",
                                                                      "t2i_shape_acc", "edit_acc", "keyframe_acc")))
    return 0


VERBS = {"export": cmd_export, "report": cmd_report, "sample": cmd_sample, "eval": cmd_eval}
