"""``difftrain`` verbs of the preference loop: ``candidates``, ``pairs``, ``align`` and ``rate`` (forwarded to the
rating app, but for ``rate export``)."""

from __future__ import annotations

import argparse
import json

from difftrain.errors import UserError, check_positive


def add_parsers(sub, add_set) -> None:
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
    p.add_argument("--guidance", type=float, default=None,
                   help="embedded guidance of a guidance-distilled model (default: sample.guidance; FLUX.1-dev 3.5)")
    p.add_argument("--batch", type=int, default=16, help="images generated together (default 16)")
    p.add_argument("--raw-weights", action="store_true", help="the raw weights instead of the EMA")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    from difftrain.cli_infer import adapter_args
    adapter_args(p)

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

    from difftrain.align.raters import READS

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
                   help="a scripted rater answering through the app's HTTP API (policy light, left, high, "
                        "each optionally +caption; noisy-MEASURE, noisy or random)")
    p.add_argument("--app", default=None, help="the app's URL (default: one started here for the rating stage)")
    p.add_argument("--gold", default=None, help="gold answers (JSONL of prompt_id and order)")
    p.add_argument("--gold-share", type=float, default=0.0, help="share of prompts made gold by --gold-measure")
    p.add_argument("--gold-measure", default="light", choices=READS,
                   help="the measure that orders gold candidates (+caption: the caption read first)")
    p.add_argument("--gold-rate", type=float, default=0.0, help="share of a rater's items that are gold")
    p.add_argument("--eval-n", type=int, default=64, help="evaluation prompts a task before and after (0: none)")
    p.add_argument("--wait", type=float, default=7 * 24 * 3600, help="seconds to wait for the ratings")
    p.add_argument("--until", default=None, choices=("candidates", "batch", "rated", "pairs", "dpo"),
                   help="stop after this stage of the current round (rerun to go on)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kind", default="ranking", choices=("ranking", "pairwise"),
                   help="ranking: one item a prompt, its K candidates ordered; pairwise: one item a pair (with "
                        "--k 2, one a prompt: the Pick-a-Pic layout; raters may answer a tie)")
    p.add_argument("--stop-confidence", type=float, default=None,
                   help="adaptive stopping: an item is served no more once its answers settle every pair at this "
                        "confidence (R is then the most an item gets)")
    p.add_argument("--min-raters", type=int, default=None, help="with --stop-confidence: the least (default 2)")
    p.add_argument("--select-items", type=int, default=0,
                   help="ask about this many pairs chosen by the model ('difftrain select'), one a prompt, "
                        "instead of every pair (with --kind pairwise)")
    p.add_argument("--select-rule", default="spread", choices=("spread", "balanced", "random"),
                   help="how the pairs are chosen (default spread: the pairs farthest apart in the model's latents; "
                        "balanced: tone and layout each on its own scale)")
    add_set(p)

    p = sub.add_parser("select", help="choose the pairs to ask raters about from a candidates folder",
                       description="Pairs chosen by the model: one pair a prompt, the ITEMS pairs farthest apart in "
                                   "the checkpoint's latent space (rule balanced or spread), written as a candidates folder the "
                                   "rating app imports as a pairwise batch (docs/rating.md).")
    p.add_argument("candidates", help="the candidates folder ('difftrain candidates')")
    p.add_argument("--items", type=int, required=True, help="pairs to ask about (at most one a prompt)")
    p.add_argument("--out", required=True, help="the folder to write (new or empty)")
    p.add_argument("--rule", default="spread", choices=("spread", "balanced", "random"))
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("rate", add_help=False,
                       help="the rating app: serve, user, import, figures, upgrade (as difftrain-rate) and export "
                            "(the app's answers -> a pairs file)",
                       description="The rating app (the difftrain-rate package). 'difftrain rate export --db URL --out "
                                   "PAIRS.parquet [--batch NAME] [--include-flagged] [--mode all|best-worst] "
                                   "[--validation F] [--seed S]' writes the pairs file with the rules of 'difftrain "
                                   "pairs'; every other command is difftrain-rate's ('difftrain rate --help').")
    p.add_argument("rest", nargs=argparse.REMAINDER)


def cmd_candidates(args) -> int:
    from difftrain.adapter_export import parse_adapter_args
    from difftrain.align.candidates import generate
    from difftrain.parallel.dist import rank_world, shutdown

    adapters = parse_adapter_args(args.adapter, args.adapter_scale)
    clean = False
    try:
        summary = generate(args.checkpoint, args.prompts, args.k, args.out, seed=args.seed, steps=args.steps,
                           cfg_scale=args.cfg_scale, guidance=args.guidance, batch=args.batch, raw_weights=args.raw_weights,
                           progress=not args.no_progress, adapters=adapters)
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
        check_positive("--" + name.replace("_", "-"), getattr(args, name))
    records = run_rounds(args.config, args.prompts, args.db, args.out, args.rounds, args.k, args.raters_per_item,
                         args.rater, args.app, args.gold, args.gold_measure, args.gold_share, args.gold_rate,
                         args.eval_n, args.wait, args.overrides, args.seed, args.until, args.kind,
                         args.min_raters, args.stop_confidence, args.select_items, args.select_rule)
    print(json.dumps({"rounds": len(records), "last": records[-1] if records else None}))
    return 0


def cmd_select(args) -> int:
    from difftrain.align.select import select_pairs

    print(json.dumps(select_pairs(args.candidates, args.out, args.items, args.rule, args.seed)))
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


VERBS = {"candidates": cmd_candidates, "pairs": cmd_pairs, "align": cmd_align, "select": cmd_select,
         "rate": cmd_rate}
