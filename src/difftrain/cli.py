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

from difftrain import cli_align, cli_infer
from difftrain.errors import UserError, check_positive

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
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also show other packages' notices at import (torchao, diffusers, transformers)")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("demo", help="generate the shapes world, train shapes-tiny on this machine, sample, "
                                    "evaluate; prints a JSON summary",
                       description="End to end on the built-in shapes world: train, sample, evaluate.")
    p.add_argument("--out", default="demo-out", help="output directory (run, sample grids, summary.json)")
    p.add_argument("--minutes", type=float, default=None,
                   help="train to a time budget of this many minutes instead of the recipe's fixed step count "
                        "(the steps, and the model, then follow this machine's speed; the summary says so)")
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

    cli_align.add_parsers(sub, _add_set)
    cli_infer.add_parsers(sub)

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
    if cfg.adapter.kind != "none":      # a frozen base: the memory of each base precision
        from difftrain.parallel.adapter_plan import adapter_plan, table
        from difftrain.parallel.planner import _check_inputs
        _check_inputs(args.gpus, args.gpu_mem, args.nodes, 8, "cuda")
        result = adapter_plan(cfg, args.gpus, args.gpu_mem, vocabulary)
        print(json.dumps(result, indent=1) if args.json else table(result, args.gpu_mem))
        if not result["fits"]:
            raise UserError(f"adapter.base_precision = {cfg.adapter.base_precision!r} does not fit {args.gpu_mem:g} GB "
                            f"GPUs ({result['precisions'][cfg.adapter.base_precision]['total_gb']} GiB a GPU)")
        return 0
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
        from difftrain.train import build_dpo_trainer as build_trainer
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
    if summary.get("interrupted"):
        return 130               # stopped by Ctrl-C (128 + SIGINT), its checkpoint written
    return cfg.health.preempt_exit_code if summary.get("preempted") else 0


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


def cmd_prepare(args) -> int:
    from difftrain.config import load_config
    from difftrain.data.prepare.job import prepare

    cfg = load_config(resolve_config(args.config), args.overrides)
    check_positive("--commit-every", args.commit_every)
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
        args = argparse.Namespace(verb="rate", rest=argv[1:], debug=False, verbose=False)
    else:
        args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, format="%(message)s",
                        stream=sys.stderr)
    if not args.debug:
        warnings.showwarning = _short_warnings
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    verbs = {"config": cmd_config, "plan": cmd_plan, "train": cmd_train, "dpo": cmd_train, "demo": cmd_demo,
             "prepare": cmd_prepare, "shapes": cmd_shapes, "bench": cmd_bench, **cli_align.VERBS, **cli_infer.VERBS}
    from difftrain.quiet import quiet_third_party
    quiet_third_party(verbose=args.verbose or args.debug)
    clean = False
    try:
        code = verbs[args.verb](args)
        clean = True
        return code
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        # a module of an optional extra (the data path, Hugging Face formats, torchao) that is not installed
        from difftrain.extras import missing_extra_message
        message = missing_extra_message(e, args.verb)
        if message is None or args.debug:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        _end_process_group(clean)


def _end_process_group(clean: bool) -> None:
    """Whatever verb ran under torchrun (sample, eval, candidates, ...): end its process group and drop the last
    references to it (the model's DTensors, FSDP state) while the interpreter is alive: gloo worker threads
    destroyed during interpreter finalisation abort a rank (SIGABRT, "terminate called without an active
    exception") after a successful run. torch is not imported here for verbs that never did."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from difftrain.parallel.dist import shutdown
        shutdown(clean)
    gc.collect()


if __name__ == "__main__":
    sys.exit(main())
