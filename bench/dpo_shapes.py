"""Does Diffusion-DPO move the model toward what raters prefer, without costing what the prompt asks for? One
round on the shapes world, from the demo's checkpoint, with an automatic rater.

The shapes world's captions leave the background shade free (a grey in ``data.background``). ``--rater direct``
prefers a lighter background: it ranks each prompt's K candidates by ``shapes.evaluate.background_shade`` (the
grey level of the background plane fitted to the image's border, pixels only). A round: ``difftrain
candidates`` (K = 4 a prompt, text-to-image prompts of a world seed the evaluation does not use), the rater,
``difftrain pairs`` (every pair; 10% of prompts held out), ``difftrain dpo`` with the ``shapes-dpo`` preset (the
demo's model sections, its round settings, ``--set`` on top). Then both models are evaluated *paired*: the same ``--n`` prompts of the
evaluation world and the same noise, before and after, text-to-image and edits.

Prints one JSON object per seed and a summary: ``preferred_rate`` before/after (share of text-to-image samples
whose background is lighter than the middle of ``data.background``) and ``preferred_rate_gain_pp``; accuracies
before/after (colour, position, shape, edit) and ``prompt_acc_drop_pp`` = the largest drop among them, with
``prompt_acc_drop_upper95_pp``, the 97.5th percentile of that largest drop over 2,000 paired bootstrap
resamples of the prompts (the upper end of a two-sided 95% interval); ``round_seconds`` (candidates, rating,
pairs and DPO; not the evaluation).

``--rater app`` runs the round through the rating app instead (``difftrain align``: the automatic rater, two noisy
raters answering at random one time in five, a spammer always at random, 3 raters an item, 15% of prompts as gold
items served at a rate of 0.2), and adds ``krippendorff_alpha``, each rater's ``gold_agreement``,
``spammer_flagged`` (to be true) and ``noisy_flagged`` (to be false).

    python bench/dpo_shapes.py [--base demo-out/run] [--seeds 0 1] [--prompts 128] [--k 4] [--n 512] [--rater app]
        [--dir DIR] [--set KEY=VALUE ...]

Without ``--base`` (or when it is missing) the demo is run first (``difftrain demo --out DIR/demo``, ~15 min).

``--efficiency`` (what each way of asking costs in human judgements and buys, for ``--preferences light left high``):
every round goes through the app with its scripted raters, who read the caption first (``--raters-read``), and gold;
the methods of ``METHODS`` below (today's ranking round, adaptive stopping, chosen pairs in one round and over two,
Pick-a-Pic's K = 2) from the same base, one seed, each evaluated paired at ``--n``; the last line is the JSON with
``settings`` saying what ran. Under an hour on 2 cores for three preferences (42 min without Pick-a-Pic); a rerun with
``--dir`` keeps finished runs and retries failed ones.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ACCS = ("color", "position", "shape")

class CliFailed(SystemExit):
    """A ``difftrain`` command that exited non-zero; ``error``: the last 'error:' line it printed."""

    def __init__(self, message: str, stderr: str):
        super().__init__(message)
        lines = [x for x in stderr.splitlines() if x.startswith("error:")]
        self.error = lines[-1][len("error:"):].strip() if lines else stderr.strip()[-300:]


def cli(*args: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "difftrain", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
        raise CliFailed(f"difftrain {args[0]} failed in {cwd} (exit {out.returncode})", out.stderr)
    return out.stdout


def base_checkpoint(args, root: Path) -> Path:
    if args.base and Path(args.base).exists():
        return Path(args.base).resolve()
    cli("demo", "--out", str(root / "demo"), "--no-progress", cwd=root)
    return (root / "demo" / "run").resolve()


def rate_direct(cands: Path, out: Path) -> None:
    from PIL import Image

    from difftrain.shapes.evaluate import background_shade

    rows = [json.loads(x) for x in (cands / "candidates.jsonl").read_text().splitlines()]
    by: dict[str, list] = {}
    for r in rows:
        with Image.open(cands / r["image"]) as im:
            by.setdefault(r["prompt_id"], []).append((background_shade(np.asarray(im.convert("RGB"))), r["id"]))
    with out.open("w") as f:
        for pid, xs in by.items():
            f.write(json.dumps({"prompt_id": pid, "rater": "direct",
                                "order": [c for _, c in sorted(xs, key=lambda x: -x[0])]}) + "\n")


def paired_eval(run: Path, n: int, world_seed: int, use_ema: bool) -> dict:
    """Per-prompt outcomes on the evaluation world: t2i attributes, background lightness, edit correctness."""
    from difftrain.evaluate import evaluate
    from difftrain.inference import guidance_scale, load_pipeline
    from difftrain.shapes import world_from_config
    from difftrain.shapes.evaluate import background_shade

    pipe, cfg, _ = load_pipeline(run, use_ema=use_ema)
    world = world_from_config(cfg.data, world_seed)
    _, gens = evaluate(pipe, world, n, cfg.sample.steps, guidance_scale(cfg, None), cfg.sample.seed,
                       tasks=("t2i", "edit"), heldout=False)
    from difftrain.align.raters import MEASURES, preferred

    t2i = [g for g in gens if g.task == "t2i"]
    edit = [g for g in gens if g.task == "edit"]
    mid = sum(cfg.data.background) / 2
    out = {a: np.array([bool(g.score[a]) for g in t2i]) for a in ACCS}
    out["edit"] = np.array([bool(g.score["ok"]) for g in edit])
    out["shade"] = np.array([background_shade(g.images[-1]) for g in t2i])
    out["preferred"] = out["shade"] > mid
    for m, f in MEASURES.items():            # each free attribute: in the preferred quarter of its range or not
        out[f"quarter_{m}"] = np.array([preferred(m, f(g.images[-1]), tuple(cfg.data.background)) for g in t2i])
    return out


def compare(before: dict, after: dict, rng: np.random.Generator, resamples: int = 2000) -> dict:
    keys = (*ACCS, "edit")
    drops = {k: 100 * (before[k].mean() - after[k].mean()) for k in keys}
    n_t2i, n_edit = len(before["color"]), len(before["edit"])
    worst = []
    for _ in range(resamples):
        i = rng.integers(0, n_t2i, n_t2i)
        j = rng.integers(0, n_edit, n_edit)
        d = [100 * (before[k][i].mean() - after[k][i].mean()) for k in ACCS]
        d.append(100 * (before["edit"][j].mean() - after["edit"][j].mean()))
        worst.append(max(d))
    return {"preferred_rate_before": round(float(before["preferred"].mean()), 4),
            "preferred_rate_after": round(float(after["preferred"].mean()), 4),
            "preferred_rate_gain_pp": round(100 * float(after["preferred"].mean() - before["preferred"].mean()), 1),
            "background_shade_before": round(float(before["shade"].mean()), 1),
            "background_shade_after": round(float(after["shade"].mean()), 1),
            "acc_before": {k: round(float(before[k].mean()), 4) for k in keys},
            "acc_after": {k: round(float(after[k].mean()), 4) for k in keys},
            "acc_drop_pp": {k: round(float(v), 1) for k, v in drops.items()},
            "prompt_acc_drop_pp": round(float(max(drops.values())), 1),
            "prompt_acc_drop_upper95_pp": round(float(np.percentile(worst, 97.5)), 1)}


def app_round(base: Path, root: Path, seed: int, args) -> dict:
    """The round through the rating app: ``difftrain align`` with the automatic rater, two noisy raters (one answer in
    five random) and a spammer (always random), 3 raters an item, gold items (a share of prompts, ordered by the
    same lightness measure) mixed in; the round's record gives the agreement and who was flagged."""
    from difftrain.config import from_dict, load_config, preset_path, to_toml
    from difftrain.shapes import world_from_config
    from difftrain.train.checkpoint import Checkpointer

    root.mkdir(parents=True, exist_ok=True)
    info = Checkpointer.read_info(base)
    base_cfg = from_dict(info["config"], "base")
    world = world_from_config(base_cfg.data, 9000 + seed)
    (root / "prompts.txt").write_text("".join(world.prompt("t2i", i) + "\n" for i in range(args.prompts)))
    cfg = load_config(preset_path(args.config), [f"run.seed={seed}", f'dpo.init="{base}"', *args.overrides])
    (root / "dpo.toml").write_text(to_toml(cfg))
    t0 = time.perf_counter()
    cli("align", "dpo.toml", "--prompts", "prompts.txt", "--db", "rate.db", "--out", "rounds", "--k", str(args.k),
        "--raters-per-item", "3", "--rater", "auto:direct:light", "--rater", "auto:noisy1:noisy",
        "--rater", "auto:noisy2:noisy", "--rater", "auto:spammer:random", "--gold-share", "0.15",
        "--gold-rate", "0.2", "--eval-n", "0", "--seed", str(seed), cwd=root)
    wall = time.perf_counter() - t0
    record = json.loads((root / "rounds" / "round_001" / "round.json").read_text())
    st = record["stages"]
    raters = st["rated"]["raters"]
    before = paired_eval(base, args.n, base_cfg.eval.seed, use_ema=True)
    after = paired_eval(Path(st["dpo"]["run"]), args.n, base_cfg.eval.seed, use_ema=False)
    return {"seed": seed, "rater": "app", **compare(before, after, np.random.default_rng(seed)),
            "round_seconds": round(wall, 1), "candidates_s": st["candidates"]["seconds"],
            "rating_s": st["rated"]["seconds"], "dpo_s": st["dpo"]["seconds"],
            "krippendorff_alpha": st["rated"]["batch"]["alpha"]["overall"],
            "gold_agreement": {n: r["gold_agreement"] for n, r in raters.items()},
            "spammer_flagged": raters["spammer"]["flagged"],
            "noisy_flagged": raters["noisy1"]["flagged"] or raters["noisy2"]["flagged"],
            "answers": {n: r["answers"] for n, r in raters.items()},
            "pairs": {k: st["pairs"].get(k) for k in ("pairs", "train", "validation", "ties_dropped")}}


def one_round(base: Path, root: Path, seed: int, args) -> dict:
    from difftrain.config import from_dict, load_config, preset_path, to_toml
    from difftrain.shapes import world_from_config
    from difftrain.train.checkpoint import Checkpointer

    root.mkdir(parents=True, exist_ok=True)
    info = Checkpointer.read_info(base)
    base_cfg = from_dict(info["config"], "base")
    world = world_from_config(base_cfg.data, 9000 + seed)         # prompts the evaluation (eval.seed) never uses
    (root / "prompts.txt").write_text("".join(world.prompt("t2i", i) + "\n" for i in range(args.prompts)))
    t0 = time.perf_counter()
    cli("candidates", str(base), "prompts.txt", "--k", str(args.k), "--out", "cands", "--seed", str(seed),
        "--no-progress", cwd=root)
    t1 = time.perf_counter()
    rate_direct(root / "cands", root / "rankings.jsonl")
    pairs = json.loads(cli("pairs", "rankings.jsonl", "--candidates", "cands", "--out", "pairs.parquet",
                           "--seed", str(seed), cwd=root).splitlines()[-1])
    t2 = time.perf_counter()
    cfg = load_config(preset_path(args.config), [f"run.seed={seed}", f'dpo.init="{base}"',
                                                 'dpo.pairs="pairs.parquet"', *args.overrides])
    (root / "dpo.toml").write_text(to_toml(cfg))
    summary = json.loads(cli("dpo", "dpo.toml", "--run-dir", "dpo", "--no-progress", cwd=root).splitlines()[-1])
    t3 = time.perf_counter()
    rows = [json.loads(x) for x in (root / "dpo" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "implicit_acc" in r][-1]
    before = paired_eval(base, args.n, base_cfg.eval.seed, use_ema=True)
    after = paired_eval(root / "dpo", args.n, base_cfg.eval.seed, use_ema=False)
    out = {"seed": seed, **compare(before, after, np.random.default_rng(seed)),
           "round_seconds": round(t3 - t0, 1), "candidates_s": round(t1 - t0, 1), "pairs_s": round(t2 - t1, 1),
           "dpo_s": round(t3 - t2, 1), "pairs": pairs, "dpo_steps": summary["steps"],
           "last_step": {k: last[k] for k in ("loss", "implicit_acc", "winner_vs_ref", "loser_vs_ref")}}
    return out


# --efficiency: what each way of asking costs in human answers and what it buys (issue: fewer answers, more gain)
RATERS = ("auto:direct:{m}", "auto:noisy1:noisy-{m}", "auto:noisy2:noisy-{m}", "auto:spammer:random")
METHODS = {
    # name: [(share of --prompts, k, kind, stop_confidence, pairs chosen as a share of --prompts[, rounds[, DPO
    # settings]]), ...]: the runs behind a method's curve; a run of several rounds asks the same way each round, each
    # round from the model the one before trained, and spends the answers of all of them
    "today": [(1.0, 4, "ranking", None, 0.0)],                       # K = 4 ranked by R = 3, every pair derived
    "adaptive": [(1.0, 4, "ranking", 0.9, 0.0)],                     # stop at M = 2 once clear, R = 3 the most
    "active_pairs": [(1.0, 4, "pairwise", 0.9, f) for f in (0.25, 0.5, 0.7)] +    # one chosen pair a prompt
                    [(1.0, 4, "pairwise", 0.9, f, 2, ["train.steps=200"]) for f in (0.25, 0.375)],  # two rounds,
                                                                    # each half the steps: one round's training
    "pickapic": [(1.0, 2, "pairwise", None, 0.0)],                   # K = 2 with ties, R = 3
}


def set_aside(root: Path) -> Path:
    """Move a failed run's folder aside (``NAME.failed-TIME``), saying why it failed, so that it is tried again
    from nothing; returns where it went."""
    why = json.loads((root / "failed.json").read_text())["failed"]         # read before the folder moves
    aside = root.with_name(f"{root.name}.failed-{time.time_ns()}")
    root.rename(aside)
    print(f"{root}: the last try failed ({why}); kept as {aside.name}, trying again", file=sys.stderr)
    return aside


def efficiency_run(base: Path, root: Path, measure: str, spec: tuple, seed: int, before: dict, args) -> dict:
    """One round through the app for one preference and one way of asking; its cost in judgements and its gain."""
    from difftrain.config import from_dict, load_config, preset_path, to_toml
    from difftrain.shapes import world_from_config
    from difftrain.train.checkpoint import Checkpointer

    share, k, kind, stop, chosen, *more = spec
    rounds = more[0] if more else 1
    sets = more[1] if len(more) > 1 else []
    prompts, select = max(2, round(share * args.prompts)), round(chosen * args.prompts)
    label = f"{prompts} prompts, K = {k}, {kind}" + (f", stop at {stop}" if stop else "") + \
        (f", {select} pairs chosen ({args.select_rule})" if select else "") + \
        (f", {rounds} rounds" if rounds > 1 else "") + "".join(f", {x}" for x in sets)
    done, failed = root / "result.json", root / "failed.json"
    if done.is_file():                    # a rerun of the bench with --dir keeps finished runs
        return json.loads(done.read_text())
    if failed.is_file():                  # a round that failed is tried again from nothing, the old one kept aside
        set_aside(root)
    root.mkdir(parents=True, exist_ok=True)
    base_cfg = from_dict(Checkpointer.read_info(base)["config"], "base")
    world = world_from_config(base_cfg.data, 9000 + seed)
    (root / "prompts.txt").write_text("".join(world.prompt("t2i", i) + "\n" for i in range(prompts)))
    cfg = load_config(preset_path(args.config), [f"run.seed={seed}", f'dpo.init="{base}"', *args.overrides, *sets])
    (root / "dpo.toml").write_text(to_toml(cfg))
    extra = ["--kind", kind] + (["--stop-confidence", str(stop), "--min-raters", "2"] if stop else []) + \
        (["--select-items", str(select), "--select-rule", args.select_rule] if select else [])
    reads = measure + ("+caption" if args.raters_read == "caption" else "")      # what the raters and gold read
    raters = [a for r in RATERS for a in ("--rater", r.format(m=reads))]
    t0 = time.perf_counter()
    try:
        cli("align", "dpo.toml", "--prompts", "prompts.txt", "--db", "rate.db", "--out", "rounds", "--k", str(k),
            "--raters-per-item", "3", *raters, "--gold-share", "0.15", "--gold-measure", reads, "--gold-rate",
            "0.2", "--eval-n", "0", "--seed", str(seed), "--rounds", str(rounds), *extra, cwd=root)
    except CliFailed as e:
        # One round that cannot finish (gold flagged too many of the four raters for R = 3 to be reached) is a
        # result to report, not the end of a bench of fifteen rounds: it counts in no figure and is tried again
        # from nothing by the next run of the bench with this --dir.
        out = {"label": label, "prompts": prompts, "k": k, "kind": kind, "stop_confidence": stop,
               "select_items": select, "rounds": rounds, "failed": e.error, "judgements": None, "gain_pp": None,
               "acc_drop_pp": None, "acc_drop_upper95_pp": None, "round_seconds": round(time.perf_counter() - t0, 1)}
        failed.write_text(json.dumps(out))
        return out
    wall = time.perf_counter() - t0
    stages = [json.loads((root / "rounds" / f"round_{i:03d}" / "round.json").read_text())["stages"]
              for i in range(1, rounds + 1)]
    st = stages[-1]
    after = paired_eval(Path(st["dpo"]["run"]), args.n, base_cfg.eval.seed, use_ema=False)
    b, a = dict(before), dict(after)
    b["preferred"], a["preferred"] = before[f"quarter_{measure}"], after[f"quarter_{measure}"]
    cmp = compare(b, a, np.random.default_rng(seed))
    out = {"label": label, "prompts": prompts, "k": k, "kind": kind, "stop_confidence": stop,
           "select_items": select, "rounds": rounds, **spent(stages),
           "gain_pp": cmp["preferred_rate_gain_pp"], "preferred_rate_after": cmp["preferred_rate_after"],
           "acc_drop_pp": cmp["prompt_acc_drop_pp"], "acc_drop_upper95_pp": cmp["prompt_acc_drop_upper95_pp"],
           "acc_drop_by_task_pp": cmp["acc_drop_pp"],
           "round_seconds": round(wall, 1)}
    done.write_text(json.dumps(out))
    return out


def spent(stages: list[dict]) -> dict:
    """What the rounds of one run spent, from each round's record (``round.json``'s stages): every round's
    judgements, gold included, summed; each round's by rater; the spammer counted as flagged only when every round
    flagged it (a round where it went unflagged counted its answers)."""
    return {"judgements": sum(x["rated"]["cost"]["judgements"] for x in stages),
            "gold_judgements": sum(x["rated"]["cost"]["gold"] for x in stages),
            "by_rater": ([x["rated"]["cost"]["by_rater"] for x in stages] if len(stages) > 1
                         else stages[0]["rated"]["cost"]["by_rater"]),
            "pairs": sum(x["pairs"].get("pairs") or 0 for x in stages),
            "ties_dropped": sum(x["pairs"].get("ties_dropped") or 0 for x in stages),
            "spammer_flagged": all(x["rated"]["raters"]["spammer"]["flagged"] for x in stages)}


def summarize_method(runs: list[dict], today_answers: int | None) -> dict:
    """The issue's figures of one method from its runs (each with its share of today's answers); runs that failed
    are listed and count in no figure."""
    failed = [r for r in runs if r.get("failed")]
    runs = [r for r in runs if not r.get("failed")]
    if not today_answers:                 # today's own round failed: nothing to count answers against
        return {"answers_fraction_for_40pp": None, "answers_fraction_for_40pp_any_accuracy": None,
                "gain_pp_at_todays_answers": None, "answers_fraction_at_todays_answers": None, "acc_drop_pp": None,
                "acc_drop_upper95_pp": None, "runs": runs, "failed_runs": failed}
    for r in runs:
        r["answers_fraction"] = round(r["judgements"] / today_answers, 4)
    # +40 points counts only within the accuracy budget (the largest drop <= 3 points); the least share at any cost
    # is reported beside it
    reach = [r for r in runs if r["gain_pp"] >= 40 and r["acc_drop_pp"] <= 3]
    reach_any = [r for r in runs if r["gain_pp"] >= 40]
    first = min(reach, key=lambda r: r["answers_fraction"]) if reach else None
    within = [r for r in runs if r["judgements"] <= today_answers]
    at_today = max(within, key=lambda r: (r["judgements"], r["gain_pp"])) if within else None
    behind = [r for r in (first, at_today) if r is not None]
    return {"answers_fraction_for_40pp": first["answers_fraction"] if first else None,
            "answers_fraction_for_40pp_any_accuracy": (min(r["answers_fraction"] for r in reach_any)
                                                       if reach_any else None),
            "gain_pp_at_todays_answers": at_today["gain_pp"] if at_today else None,
            "answers_fraction_at_todays_answers": at_today["answers_fraction"] if at_today else None,
            "acc_drop_pp": max((r["acc_drop_pp"] for r in behind), default=None),
            "acc_drop_upper95_pp": max((r["acc_drop_upper95_pp"] for r in behind), default=None),
            "runs": runs, "failed_runs": failed}


def plot_efficiency(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefs = result["preferences"]
    fig, axes = plt.subplots(1, len(prefs), figsize=(4.2 * len(prefs), 3.6), sharey=True, squeeze=False)
    for ax, (pref, methods) in zip(axes[0], prefs.items()):
        for name, m in methods.items():
            color = f"C{list(METHODS).index(name) % 10}"          # a method keeps its colour in every panel
            every = [r for r in m["runs"] if "answers_fraction" in r]       # none when today's round failed
            for n in sorted({r.get("rounds", 1) for r in every}):          # a line for each number of rounds
                counted = [r for r in every if r.get("rounds", 1) == n]
                xs = [r["answers_fraction"] for r in counted]
                ys = [r["gain_pp"] for r in counted]
                order = np.argsort(xs)
                ax.plot(np.array(xs)[order], np.array(ys)[order], marker="o" if n == 1 else "s", color=color,
                        ls="-" if n == 1 else "--", label=name if n == 1 else f"{name}, {n} rounds")
                over = [(x, y) for x, y, r in zip(xs, ys, counted) if r["acc_drop_pp"] > 3]   # past the budget
                if over:
                    ax.plot(*zip(*over), ls="none", marker="o" if n == 1 else "s", mfc="white", mec=color)
        ax.axhline(40, color="grey", lw=0.8, ls="--")
        ax.axvline(0.25, color="grey", lw=0.8, ls=":")
        ax.set_title(f"{pref} (before {result['preferred_rate_before'][pref]:.2f})")
        ax.set_xlabel("human judgements / today's round")
    axes[0][0].set_ylabel("preference gain (points)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("hollow: a run whose accuracy drop is over 3 points", fontsize=9, y=0.995)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def efficiency(args, root: Path, base: Path) -> dict:
    from difftrain.config import from_dict
    from difftrain.train.checkpoint import Checkpointer

    t0 = time.perf_counter()
    base_cfg = from_dict(Checkpointer.read_info(base)["config"], "base")
    before = paired_eval(base, args.n, base_cfg.eval.seed, use_ema=True)
    seed = args.seeds[0]
    out: dict = {"preferences": {}, "preferred_rate_before": {}}
    for measure in args.preferences:
        out["preferred_rate_before"][measure] = round(float(before[f"quarter_{measure}"].mean()), 4)
        runs = {}
        for name in args.methods:
            runs[name] = []
            for i, spec in enumerate(METHODS[name]):
                folder = f"eff-{measure}" + ("+caption" if args.raters_read == "caption" else "")
                r = efficiency_run(base, root / folder / f"{name}-{i}", measure, spec, seed, before, args)
                print(json.dumps({"preference": measure, "method": name, **r}), flush=True)
                runs[name].append(r)
        today = runs["today"][0]["judgements"]          # None when today's round failed
        out["preferences"][measure] = {name: summarize_method(rs, today) for name, rs in runs.items()}
        out["preferences"][measure]["today_judgements"] = today
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["settings"] = {"base": str(base), "seed": seed, "n": args.n, "config": args.config,
                       "overrides": args.overrides, "raters": list(RATERS), "raters_read": args.raters_read,
                       "select_rule": args.select_rule,
                       "gold": "15% of prompts, rate 0.2",
                       "methods": {k: [list(x) for x in v] for k, v in METHODS.items() if k in args.methods}}
    if args.plot:
        plot_efficiency({**out, "preferences": {p: {k: v for k, v in m.items() if k != "today_judgements"}
                                                for p, m in out["preferences"].items()}}, Path(args.plot))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="demo-out/run", help="the checkpoint (run directory) DPO starts from")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--prompts", type=int, default=128, help="text-to-image prompts ranked in the round")
    ap.add_argument("--k", type=int, default=4, help="candidates a prompt")
    ap.add_argument("--n", type=int, default=512, help="evaluation prompts per task (paired before/after)")
    ap.add_argument("--rater", default="direct", choices=("direct", "app"),
                    help="direct: the automatic rater ranks the files; app: it, two noisy raters and a spammer rank "
                         "through the rating app's HTTP API ('difftrain align')")
    ap.add_argument("--config", default="shapes-dpo", help="the DPO config (preset name or path; default shapes-dpo)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--efficiency", action="store_true",
                    help="answers against gain: each preference x each way of asking, through the app (one seed)")
    ap.add_argument("--preferences", nargs="+", default=["light", "left", "high"],
                    help="--efficiency: the free attributes raters prefer (light, left, high)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                    help="--efficiency: the ways of asking (today is always run: the others are counted against it)")
    ap.add_argument("--select-rule", default="spread", choices=("spread", "balanced", "random"),
                    help="--efficiency: how active_pairs chooses its pairs ('difftrain select --rule'); a --dir "
                         "keeps finished runs, so give each rule a --dir of its own")
    ap.add_argument("--raters-read", default="caption", choices=("pixels", "caption"),
                    help="--efficiency: what the honest and noisy raters (and gold) look at: the caption first (the "
                         "default: an image that does not show it ranks last, two such images are 'both bad'), as "
                         "people do, or the preference's measure alone")
    ap.add_argument("--plot", default=None, help="--efficiency: write the curves (answers -> gain) to this PNG")
    args = ap.parse_args()
    if args.efficiency and "today" not in args.methods:
        args.methods = ["today", *args.methods]
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(args.dir) if args.dir else Path(tmp)
        base = base_checkpoint(args, root)
        if args.efficiency:
            print(json.dumps(efficiency(args, root, base)))
            return
        rounds = []
        for seed in args.seeds:
            r = (app_round if args.rater == "app" else one_round)(base, root / f"seed{seed}", seed, args)
            print(json.dumps(r), flush=True)
            rounds.append(r)
        keys = ("preferred_rate_gain_pp", "prompt_acc_drop_pp", "prompt_acc_drop_upper95_pp", "round_seconds") + \
            (("krippendorff_alpha", "spammer_flagged", "noisy_flagged") if args.rater == "app" else ())
        print(json.dumps({"summary": {k: [r[k] for r in rounds] for k in keys}, "base": str(base),
                          "settings": {"prompts": args.prompts, "k": args.k, "n": args.n, "config": args.config,
                                       "overrides": args.overrides}}))


if __name__ == "__main__":
    main()
