"""``difftrain`` command line: parses, loads config, calls one function per verb.

User errors (bad config, missing file, wrong flag value) print one line and exit 2; ``--debug``
shows the traceback. Warnings (e.g. a truncated prompt) print one line each.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import warnings
from pathlib import Path

from difftrain.errors import UserError

def resolve_config(name: str) -> Path:
    """A config path, or the name of a shipped preset (``shapes-tiny``, ``flux-dev``, ``dit-24b``)."""
    from difftrain.config import preset_path

    return preset_path(name)


def _add_run_args(p) -> None:
    """The arguments of a training run (``train`` and ``dpo``)."""
    p.add_argument("config", help="config path or preset name")
    p.add_argument("--run-dir", default=None, help="run directory (default: run.out_dir/run.name)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines instead)")
    p.add_argument("--no-resume", action="store_true",
                   help="refuse to start if the run directory already holds a checkpoint")
    p.add_argument("--allow-config-change", nargs="+", default=[], metavar="KEY",
                   help="config keys (or sections) that may differ from the checkpoint's when resuming")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (local rank r: port + r); sets train.metrics_port")
    _add_set(p)


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key (repeatable), e.g. --set train.lr=1e-4; "
                        "'difftrain config keys' lists every key")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="difftrain", description="Train diffusion transformers (text-to-image, editing, keyframes).")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("demo", help="generate the shapes world, train shapes-tiny on this machine, sample, "
                                    "evaluate; prints a JSON summary",
                       description="End to end on the built-in shapes world: train, sample, evaluate.")
    p.add_argument("--out", default="demo-out", help="output directory (run, sample grids, summary.json)")
    p.add_argument("--minutes", type=float, default=None,
                   help="training time budget in minutes (default: the preset's train.minutes)")
    p.add_argument("--config", default="shapes-tiny", help="config path or preset name (default shapes-tiny)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines instead)")
    _add_set(p)

    p = sub.add_parser("train", help="train from a config; rerun on the same run directory to resume",
                       description="Train a model. Resumes from the newest complete, verified checkpoint in the "
                                   "run directory.")
    _add_run_args(p)

    p = sub.add_parser("dpo", help="Diffusion-DPO from a checkpoint on a pairs file (the [dpo] section); rerun on "
                                   "the same run directory to resume",
                       description="Diffusion-DPO on the trainer: the policy starts from dpo.init, the reference is "
                                   "a frozen copy of it, the data is dpo.pairs (see docs/dpo.md).")
    _add_run_args(p)

    p = sub.add_parser("candidates", help="K candidates per prompt from a checkpoint, with a manifest (resumable)",
                       description="K candidates per prompt (text-to-image, edits, keyframes) for raters and DPO; "
                                   "rerun the same command to finish a killed run (see docs/dpo.md).")
    p.add_argument("checkpoint", help="checkpoint directory, RUN/checkpoints/latest, or a run directory")
    p.add_argument("prompts", help="a .txt file (one prompt a line) or .jsonl (prompt, task, source, frames, id)")
    p.add_argument("--k", type=int, default=4, help="candidates per prompt (default 4)")
    p.add_argument("--out", required=True, help="the candidates folder (manifest.json, candidates.jsonl, images/)")
    p.add_argument("--seed", type=int, default=0, help="noise seeds are drawn from (seed, prompt id, k)")
    p.add_argument("--steps", type=int, default=None, help="sampling steps (default: sample.steps)")
    p.add_argument("--cfg-scale", type=float, default=None, help="guidance scale (default: sample.cfg_scale)")
    p.add_argument("--batch", type=int, default=16, help="images generated together (default 16)")
    p.add_argument("--raw-weights", action="store_true", help="the raw weights instead of the EMA")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("pairs", help="rankings of candidates (or a Pick-a-Pic file) -> preference pairs (Parquet)",
                       description="Preference pairs for 'difftrain dpo': majority over raters, ties dropped, "
                                   "split by prompt (see docs/dpo.md).")
    p.add_argument("rankings", help="rankings JSONL (prompt_id, rater, order), or a Pick-a-Pic Parquet file with "
                                    "--pickapic")
    p.add_argument("--candidates", default=None, help="the candidates folder the rankings rank")
    p.add_argument("--out", required=True, help="the pairs file to write (.parquet)")
    p.add_argument("--mode", default="all", choices=("all", "best-worst"),
                   help="every ranked pair of a prompt's candidates, or its best against its worst")
    p.add_argument("--validation", type=float, default=0.1, help="share of prompts held out (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/validation split")
    p.add_argument("--pickapic", action="store_true", help="the input is in the Pick-a-Pic layout")
    p.add_argument("--image-size", type=int, default=0,
                   help="with --pickapic: centre-crop and resize images to this size (0 = as they are)")

    p = sub.add_parser("align", help="preference rounds: candidates -> the rating app -> pairs -> DPO -> eval, "
                                     "each round resumable at any stage",
                       description="Preference rounds (see docs/rating.md): candidates from the round's checkpoint, "
                                   "a batch in the rating app, its answers as pairs, DPO, evaluation; rerun to resume.")
    p.add_argument("config", help="the DPO config (preset name or path); dpo.init is the first round's checkpoint")
    p.add_argument("--prompts", required=True, help="the prompts file (as 'difftrain candidates' reads)")
    p.add_argument("--db", required=True, help="the rating app's database (SQLite path or postgresql://...)")
    p.add_argument("--out", required=True, help="the rounds' folder (round_001/, ...)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--k", type=int, default=4, help="candidates a prompt")
    p.add_argument("--raters-per-item", type=int, default=3, help="R: distinct raters an item")
    p.add_argument("--rater", action="append", default=[], metavar="auto:NAME[:POLICY]",
                   help="a scripted rater answering through the app's HTTP API (policy light, noisy or random)")
    p.add_argument("--app", default=None, help="the app's URL (default: one started here for the rating stage)")
    p.add_argument("--gold", default=None, help="gold answers (JSONL of prompt_id and order)")
    p.add_argument("--gold-share", type=float, default=0.0, help="share of prompts made gold by --gold-measure")
    p.add_argument("--gold-measure", default="light", help="the measure that orders gold candidates")
    p.add_argument("--gold-rate", type=float, default=0.0, help="share of a rater's items that are gold")
    p.add_argument("--eval-n", type=int, default=64, help="evaluation prompts a task before and after (0: none)")
    p.add_argument("--wait", type=float, default=7 * 24 * 3600, help="seconds to wait for the ratings")
    p.add_argument("--until", default=None, choices=("candidates", "batch", "rated", "pairs", "dpo"),
                   help="stop after this stage of the current round (rerun to go on)")
    p.add_argument("--seed", type=int, default=0)
    _add_set(p)

    p = sub.add_parser("rate", add_help=False,
                       help="the rating app: serve, user, import, figures, upgrade (as difftrain-rate) and export "
                            "(the app's answers -> a pairs file)",
                       description="The rating app (the difftrain-rate package). 'difftrain rate export --db URL --out "
                                   "PAIRS.parquet [--batch NAME] [--include-flagged] [--mode all|best-worst] "
                                   "[--validation F] [--seed S]' writes the pairs file with the rules of 'difftrain "
                                   "pairs'; every other command is difftrain-rate's ('difftrain rate --help').")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p = sub.add_parser("export", help="consolidated safetensors weights (EMA or raw) and config from a checkpoint",
                       description="Write a checkpoint's weights as one safetensors file with its config, from "
                                   "any number of shards; or a diffusers FluxTransformer2DModel folder.")
    p.add_argument("checkpoint", help="checkpoint directory, RUN/checkpoints/latest, or a run directory")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--weights", choices=("ema", "raw"), default="ema", help="EMA (default) or raw weights")
    p.add_argument("--layout", choices=("difftrain", "diffusers"), default="difftrain",
                   help="difftrain: model.safetensors + config.toml; diffusers: transformer/ in diffusers' layout")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the written tensors")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--quant", choices=("fp8", "mxfp8", "nvfp4"), default=None,
                   help="write the linears sample --quant quantizes in that format, with their scales (difftrain "
                        "layout; for serving: model.init_from refuses it)")

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
    p.add_argument("--out", default=None, help="output directory (default: RUN/samples/cli)")
    p.add_argument("--raw-weights", action="store_true", help="use the raw weights instead of the EMA")
    _quant_arg(p)

    p = sub.add_parser("eval", help="evaluate a checkpoint on the shapes world",
                       description="Generate for N prompts per task and read them back with the shapes evaluator.")
    p.add_argument("checkpoint", help="checkpoint directory, RUN/checkpoints/latest, or a run directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--n", type=int, default=None, help="prompts per task (default: eval.n)")
    p.add_argument("--steps", type=int, default=None, help="Euler steps (default: sample.steps)")
    p.add_argument("--cfg-scale", type=float, default=None, help="guidance scale (default: sample.cfg_scale)")
    p.add_argument("--seed", type=int, default=None,
                   help="draw another prompt set and other noise (default: eval.seed and sample.seed)")
    p.add_argument("--grid", default=None, help="also write a PNG grid of the generated samples here")
    _quant_arg(p)

    p = sub.add_parser("bench", help="measure kernels for a config on this machine",
                       description="Measure kernels for a config on this machine.")
    bsub = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    att = bsub.add_parser("attention", help="every attention shape of the config: each backend's ms, the winner, "
                                             "the hybrid's speed-up (the table attention.backend = 'auto' uses)")
    att.add_argument("config", help="config path or preset name")
    att.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"),
                     help="default: train.precision's compute dtype on this device")
    att.add_argument("--inference", action="store_true", help="forward only (no backward): sampling's kernels")
    att.add_argument("--micro-batch", type=int, default=None, help="default: the config's micro-batch per rank")
    att.add_argument("--reps", type=int, default=5)
    att.add_argument("--backends", nargs="+", default=None, help="default: every backend")
    att.add_argument("--cache", default=None, help="read and write the tuning cache here")
    _add_set(att)

    p = sub.add_parser("plan", help="memory per GPU of each parallel strategy, which fit, the recommendation",
                       description="Estimate per-GPU memory (parameters, gradients, optimizer state, activations, "
                                   "encoders, buffers) and step-time cost of DDP / FSDP / HSDP, each with and "
                                   "without CPU offload and activation checkpointing (and context parallelism "
                                   "where the sequence needs it); recommend the fastest that fits, sharding "
                                   "before recomputation. Exits 2 when nothing fits, saying what would.")
    p.add_argument("config", help="config path or preset name")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu-mem", type=float, required=True, metavar="GB", help="memory per GPU (GiB)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: GPUs / 8)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_set(p)

    p = sub.add_parser("prepare", help="curate raw image-caption data and encode it into the latent store",
                       description="List data.sources, read facts and apply data.filters as Ray Data operations "
                                   "(every input row lands in STORE/curation.parquet with its outcome and reason, "
                                   "swapped in when the prepare succeeds), then encode the kept samples on "
                                   "data.encoder_actors actors into Lance tables per (stage, bucket, task). "
                                   "Resumable: a re-run only encodes what is missing.")
    p.add_argument("config", help="config path or preset name")
    p.add_argument("--dry-run", action="store_true", help="print the counts per outcome and reason; encode nothing")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start Ray locally)")
    p.add_argument("--overwrite", action="store_true",
                   help="write tables whose cache key differs as new Lance versions instead of refusing")
    p.add_argument("--commit-every", type=int, default=256, metavar="ROWS",
                   help="rows per table between Lance commits (what a killed run keeps; default 256)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_set(p)

    p = sub.add_parser("shapes", help="the shapes world as files", description="The shapes world as a dataset.")
    ssub = p.add_subparsers(dest="shapes_verb", required=True, metavar="ACTION")
    ex = ssub.add_parser("export", help="write the shapes world as raw files (images, captions, edits, clips)")
    ex.add_argument("dir", help="output directory")
    ex.add_argument("--seed", type=int, default=0, help="world seed (default 0)")
    ex.add_argument("--n", type=int, nargs=3, default=None, metavar=("T2I", "EDIT", "KEYFRAMES"),
                    help="examples per task (default: from --config, else 600 400 200)")
    ex.add_argument("--config", default=None,
                    help="size the export for this training config (path or preset): its buckets' scene sizes and "
                         "aspects, its frames and motion, and per task enough scenes for --epochs passes of the run")
    ex.add_argument("--epochs", type=float, default=1.0,
                    help="with --config: about how often the run sees each scene (default 1: every sample a new "
                         "scene, as on the fly; 4 is a quarter of the files and prepare time, at some 5 points of "
                         "shape accuracy)")

    p = sub.add_parser("config", help="inspect configs", description="Inspect configs.")
    csub = p.add_subparsers(dest="config_verb", required=True, metavar="ACTION")
    show = csub.add_parser("show", help="print the resolved config and the model's parameter count")
    show.add_argument("file", help="config path or preset name")
    show.add_argument("--json", action="store_true", help="print JSON (with num_params) instead of TOML")
    _add_set(show)
    csub.add_parser("keys", help="list every config key with its default and meaning")
    return parser


def _check_positive(name: str, value, minimum=1) -> None:
    if value is not None and value < minimum:
        raise UserError(f"{name} {value}: expected a value >= {minimum}")


def cmd_config(args) -> int:
    from difftrain.config import describe, load_config, to_dict, to_toml
    from difftrain.models import build_dit, config_dit_params, num_params

    if args.config_verb == "keys":
        for key, default, doc in describe():
            print(f"{key} = {default}\n    {doc}")
        return 0
    cfg = load_config(resolve_config(args.file), args.overrides)
    params = config_dit_params(cfg)
    n = num_params(build_dit(params, device="meta"))
    if args.json:
        print(json.dumps({**to_dict(cfg), "num_params": n}, indent=1))
    else:
        print(to_toml(cfg) + f"# model parameters (DiT): {n:,} ({n / 1e9:.2f}B)")
    return 0


def cmd_plan(args) -> int:
    from difftrain.config import load_config
    from difftrain.parallel.planner import plan
    from difftrain.sources import vocabulary_for

    cfg = load_config(resolve_config(args.config), args.overrides)
    vocabulary = vocabulary_for(cfg) if cfg.text.kind == "words" else None
    result = plan(cfg, args.gpus, args.gpu_mem, args.nodes, vocabulary=vocabulary)
    print(json.dumps(result.to_json(), indent=1) if args.json else result.table())
    result.require_fit()      # nothing fits: the table is printed, then one error line and exit 2
    return 0


def cmd_train(args) -> int:
    """One process of a (possibly distributed) run: under torchrun every rank runs this. The process group
    lives exactly as long as this function, errors included."""
    from difftrain.config import load_config
    from difftrain.parallel.dist import init_distributed, shutdown
    from difftrain.progress import run_training
    if args.verb == "dpo":
        from difftrain.train.dpo import build_dpo_trainer as build_trainer
    else:
        from difftrain.train import build_trainer

    overrides = list(args.overrides)
    if args.metrics_port is not None:
        overrides.append(f"train.metrics_port={args.metrics_port}")
    cfg = load_config(resolve_config(args.config), overrides)
    clean, trainer, env = False, None, None
    try:
        env = init_distributed(cfg)
        if not env.is_main:       # one voice on the console: rank 0's (every rank keeps its own JSON log)
            for h in logging.getLogger().handlers:
                h.setLevel(logging.WARNING)
        trainer = build_trainer(cfg, args.run_dir, env=env, resume=not args.no_resume,
                                allow_config_change=tuple(args.allow_config_change))
        if env.is_main:
            summary = run_training(cfg, args.run_dir, progress=not args.no_progress, trainer=trainer)
            print(json.dumps(summary))
        else:
            summary = trainer.fit()
        clean = True
    finally:
        if trainer is not None:
            trainer.close()
        shutdown(clean)
        # Drop the last references to process groups (held by the mesh, FSDP state and DTensors) while the
        # interpreter is alive: gloo worker threads destroyed during interpreter finalisation abort the
        # process (SIGABRT, "terminate called without an active exception") after a successful run.
        del trainer, env
        gc.collect()
    return cfg.health.preempt_exit_code if summary.get("preempted") else 0


def cmd_candidates(args) -> int:
    from difftrain.align.candidates import generate
    from difftrain.parallel.dist import rank_world, shutdown

    clean = False
    try:
        summary = generate(args.checkpoint, args.prompts, args.k, args.out, seed=args.seed, steps=args.steps,
                           cfg_scale=args.cfg_scale, batch=args.batch, raw_weights=args.raw_weights,
                           progress=not args.no_progress)
        clean = True
    finally:
        shutdown(clean)
    if rank_world()[0] == 0:
        print(json.dumps(summary))
    return 0


def cmd_pairs(args) -> int:
    from difftrain.align.pairs import make_pairs, pickapic_pairs

    if args.pickapic:
        summary = pickapic_pairs(args.rankings, args.out, args.validation, args.seed, args.image_size)
    else:
        if not args.candidates:
            raise UserError("--candidates DIR is needed: the candidates folder the rankings rank")
        summary = make_pairs(args.rankings, args.candidates, args.out, args.mode, args.validation, args.seed)
    print(json.dumps(summary))
    return 0


def cmd_align(args) -> int:
    from difftrain.align.loop import run_rounds

    for name in ("rounds", "k", "raters_per_item"):
        _check_positive("--" + name.replace("_", "-"), getattr(args, name))
    records = run_rounds(args.config, args.prompts, args.db, args.out, args.rounds, args.k, args.raters_per_item,
                         args.rater, args.app, args.gold, args.gold_measure, args.gold_share, args.gold_rate,
                         args.eval_n, args.wait, args.overrides, args.seed, args.until)
    print(json.dumps({"rounds": len(records), "last": records[-1] if records else None}))
    return 0


def cmd_bench(args) -> int:
    from difftrain.config import load_config, preset_path
    from difftrain.diffusion.pipeline import amp_dtype, pick_device
    from difftrain.models.kernels import BACKENDS, backend
    from difftrain.parallel.dist import batch_split
    from difftrain.parallel.tune import attention_shapes, dtype_name, summary, tune

    cfg = load_config(preset_path(args.config), args.overrides)
    for b in args.backends or []:
        backend(b)
    device = pick_device()
    dtype = args.dtype or dtype_name(amp_dtype(cfg.train.precision, device))
    micro = args.micro_batch or batch_split(cfg.train.global_batch, cfg.train.micro_batch, 1)[0]
    shapes = attention_shapes(cfg, micro, dtype, max(1, cfg.parallel.cp))
    results = tune(shapes, device, not args.inference, args.cache, args.backends, args.reps,
                   max(1, cfg.parallel.cp))
    print(json.dumps({"device": str(device), "dtype": dtype, "training": not args.inference,
                      "backends": {n: b.doc for n, b in BACKENDS.items()}, "shapes": results,
                      **summary(results)}, indent=1))
    return 0


def cmd_rate(args) -> int:
    try:
        from difftrain_rate import cli as rate_cli
    except ImportError:
        raise UserError("the rating app is a package of its own: pip install ./rate (no torch needed)") from None
    rest = list(args.rest)
    if not rest or rest[0] != "export":
        rate_cli.main(rest or ["--help"])
        return 0
    import tempfile

    from difftrain.align.pairs import MODES, make_pairs
    from difftrain_rate.errors import RateError
    from difftrain_rate.export import write_rankings

    ap = argparse.ArgumentParser(prog="difftrain rate export",
                                 description="the app's answers -> a pairs file (the rules of 'difftrain pairs')")
    ap.add_argument("--db", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch")
    ap.add_argument("--include-flagged", action="store_true")
    ap.add_argument("--mode", default="all", choices=MODES)
    ap.add_argument("--validation", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(rest[1:])
    try:
        db = rate_cli._db(a.db)
        with tempfile.TemporaryDirectory() as tmp:
            got = write_rankings(db, f"{tmp}/rankings.jsonl", a.batch, a.include_flagged)
            if not got["folders"]:
                raise UserError(f"--db {a.db}: no batch of one candidates folder to export (comparisons are not "
                                "preference pairs)")
            if len(got["folders"]) != 1:
                raise UserError(f"--db {a.db}: the answers are of {len(got['folders'])} candidates folders "
                                f"({got['folders']}); a pairs file is of one: choose a batch with --batch")
            if not got["rankings"]:
                raise UserError(f"--db {a.db}: no answers to export" + (f" in batch {a.batch!r}" if a.batch else ""))
            summary = make_pairs(f"{tmp}/rankings.jsonl", got["folders"][0], a.out, a.mode, a.validation, a.seed)
    except RateError as e:
        raise UserError(str(e)) from None
    summary["rankings"] = got["rankings"]
    print(json.dumps(summary))
    return 0


def cmd_export(args) -> int:
    from difftrain.export import export_checkpoint

    print(json.dumps(export_checkpoint(args.checkpoint, args.out, weights=args.weights, layout=args.layout,
                                       dtype=args.dtype, overwrite=args.overwrite, quant=args.quant)))
    return 0


def cmd_report(args) -> int:
    from difftrain.report import write_report

    print(json.dumps(write_report(args.run_dir, args.out)))
    return 0


def _quant_arg(p) -> None:
    p.add_argument("--quant", choices=("fp8", "mxfp8", "nvfp4"), default=None,
                   help="quantize the DiT's block linears for inference through torchao (bf16 around them); "
                        "emulated in bf16 where the hardware lacks the format, and labelled so (docs/kernels.md)")


def cmd_sample(args) -> int:
    _check_positive("--num-images", args.num_images)
    _check_positive("--steps", args.steps)
    if args.frames is not None and args.frames < 1:
        raise UserError(f"--frames {args.frames}: expected a number of keyframes >= 1")
    from difftrain.images import caption_grid, read_image, write_png
    from difftrain.inference import guidance_scale, load_pipeline, request_batch

    pipe, cfg, info = load_pipeline(args.checkpoint, use_ema=not args.raw_weights, quant=args.quant)
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
    print(json.dumps({"images": written, "grid": str(grid), **({"quant": info["quant"]} if args.quant else {})}))
    return 0


def cmd_eval(args) -> int:
    _check_positive("--n", args.n)
    _check_positive("--steps", args.steps)
    from difftrain.evaluate import EVAL_KEYS, eval_buckets, evaluate_buckets
    from difftrain.images import caption_grid
    from difftrain.inference import guidance_scale, load_pipeline

    pipe, cfg, info = load_pipeline(args.checkpoint, quant=args.quant)
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
        print(json.dumps({**{k: metrics[k] for k in EVAL_KEYS}, "stage": metrics["stage"],
                          **({"quant": info["quant"]} if args.quant else {}),
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


def cmd_prepare(args) -> int:
    from difftrain.config import load_config
    from difftrain.data.prepare import prepare

    cfg = load_config(resolve_config(args.config), args.overrides)
    _check_positive("--commit-every", args.commit_every)
    summary = prepare(cfg, dry_run=args.dry_run, ray_address=args.ray_address, overwrite=args.overwrite,
                      progress=not args.no_progress, commit_every=args.commit_every)
    summary.pop("write_pids", None)
    if args.dry_run:
        width = max([len(r) for r in summary["reasons"]] + [8])
        for reason, n in sorted(summary["reasons"].items(), key=lambda kv: -kv[1]):
            print(f"{reason:{width}s} {n}", file=sys.stderr)
    print(json.dumps(summary))
    return 0


def cmd_shapes(args) -> int:
    from difftrain.shapes.export import export_shapes

    kwargs = {"seed": args.seed}
    if args.config is not None:
        from difftrain.config import load_config
        from difftrain.shapes.export import export_plan

        if args.epochs <= 0:
            raise UserError(f"--epochs {args.epochs}: expected a positive number")
        try:
            kwargs.update(export_plan(load_config(resolve_config(args.config), []), args.epochs))
        except ValueError as e:
            raise UserError(f"--config {args.config}: {e}") from None
    if args.n is not None:
        if min(args.n) < 0:
            raise UserError(f"--n {args.n}: expected counts >= 0")
        kwargs["n"] = tuple(args.n)
    print(json.dumps(export_shapes(args.dir, **kwargs)))
    return 0


def cmd_demo(args) -> int:
    from difftrain.demo import run_demo

    if args.minutes is not None and args.minutes <= 0:
        raise UserError(f"--minutes {args.minutes}: expected a positive number of minutes")
    summary = run_demo(resolve_config(args.config), Path(args.out), args.minutes, args.overrides,
                       progress=not args.no_progress)
    print(json.dumps(summary))
    return 0


def _short_warnings(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["rate"]:            # everything after 'rate' is the rating app's (its own --help included)
        args = argparse.Namespace(verb="rate", rest=argv[1:], debug=False)
    else:
        args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, format="%(message)s",
                        stream=sys.stderr)
    if not args.debug:
        warnings.showwarning = _short_warnings
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    verbs = {"config": cmd_config, "plan": cmd_plan, "train": cmd_train, "dpo": cmd_train, "candidates": cmd_candidates,
             "pairs": cmd_pairs, "sample": cmd_sample, "eval": cmd_eval, "demo": cmd_demo,
             "prepare": cmd_prepare, "shapes": cmd_shapes, "export": cmd_export, "report": cmd_report,
             "rate": cmd_rate, "align": cmd_align, "bench": cmd_bench}
    try:
        return verbs[args.verb](args)
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
