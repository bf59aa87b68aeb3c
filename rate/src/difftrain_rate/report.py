"""What the admin page shows and what is exported, computed from the database.

A rater is **flagged** when they answered at least ``MIN_GOLD`` gold units and agree with gold on less than
``GOLD_THRESHOLD`` of them; flagged raters are left out of the figures of agreement and alpha, of win rates and of
the export unless asked for.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from sqlalchemy import func, select

from difftrain_rate.db import SLOTS_PER_R, Answer, Database, Image, Item, RatingBatch, User
from difftrain_rate.stats import (bradley_terry, gold_score, krippendorff_alpha, majority, preferences, wilson)

GOLD_THRESHOLD = 0.7
MIN_GOLD = 5


def _load(s, batch_ids: list[int] | None = None):
    q = (select(Answer, Item, User.name).join(Item, Item.id == Answer.item_id).join(User, User.id == Answer.rater_id))
    if batch_ids is not None:
        q = q.where(Item.batch_id.in_(batch_ids))
    return s.execute(q).all()


def is_flagged(gold_score_sum: float, gold_units: int) -> bool:
    """The rule: at least MIN_GOLD gold units answered, agreeing with gold on less than GOLD_THRESHOLD of them."""
    return gold_units >= MIN_GOLD and gold_score_sum / gold_units < GOLD_THRESHOLD


def rater_flagged(s, rater: int) -> bool:
    """``is_flagged`` for one rater from their gold answers alone (what each gold answer updates)."""
    score, units = 0.0, 0
    rows = s.execute(select(Answer.order, Answer.outcome, Item.images, Item.gold).join(Item, Item.id == Answer.item_id)
                     .where(Answer.rater_id == rater, Item.gold.is_not(None))).all()
    for order, outcome, images, gold in rows:
        handles = [v[0] for v in images]
        sc, n = gold_score(preferences(order, outcome, handles), preferences(gold, "ranked", handles))
        score, units = score + sc, units + n
    return is_flagged(score, units)


def rater_quality(s) -> dict[str, dict]:
    """Per rater: answers, median seconds an item, gold units and agreement, agreement with the majority, flagged."""
    rows = _load(s)
    out: dict[str, dict] = defaultdict(lambda: {"answers": 0, "seconds": [], "gold_score": 0.0, "gold_units": 0,
                                                "maj_agree": 0, "maj_units": 0})
    units: dict[tuple, dict[str, int]] = defaultdict(dict)
    for ans, item, name in rows:
        r = out[name]
        r["answers"] += 1
        r["seconds"].append(ans.seconds)
        prefs = preferences(ans.order, ans.outcome, [v[0] for v in item.images])
        if item.gold is not None:
            gold = preferences(item.gold, "ranked", [v[0] for v in item.images])
            sc, n = gold_score(prefs, gold)
            r["gold_score"] += sc
            r["gold_units"] += n
        else:
            for u, v in prefs.items():
                units[(item.id, u)][name] = v
    for votes in units.values():
        if len(votes) < 2:
            continue
        for name, v in votes.items():
            others = [w for n, w in votes.items() if n != name]
            m = majority(others)
            if m is not None:
                out[name]["maj_units"] += 1
                out[name]["maj_agree"] += int(v == m)
    result = {}
    for name, r in sorted(out.items()):
        gold = r["gold_score"] / r["gold_units"] if r["gold_units"] else None
        result[name] = {"answers": r["answers"], "median_seconds": round(statistics.median(r["seconds"]), 2),
                        "gold_units": r["gold_units"], "gold_agreement": None if gold is None else round(gold, 4),
                        "majority_agreement": round(r["maj_agree"] / r["maj_units"], 4) if r["maj_units"] else None,
                        "flagged": is_flagged(r["gold_score"], r["gold_units"])}
    return result


def flagged(s) -> set[str]:
    return {n for n, r in rater_quality(s).items() if r["flagged"]}


def batch_progress(s, batch: RatingBatch) -> dict:
    """Items (gold left out); those ``complete`` (R answers that count: no skip, no flagged rater; or, with adaptive
    stopping, settled) and those ``given_up`` (every one of their 2R slots answered without reaching R); answers
    against the target (with adaptive stopping: the most). Counts only."""
    from difftrain_rate.db import Assignment

    ordinary = (Item.batch_id == batch.id, Item.gold.is_(None))
    n_items = s.scalar(select(func.count()).select_from(Item).where(*ordinary)) or 0
    counting = dict(s.execute(select(Answer.item_id, func.count()).join(Item, Item.id == Answer.item_id)
                              .join(Assignment, Assignment.id == Answer.assignment_id)
                              .where(*ordinary, Assignment.counts.is_(True)).group_by(Answer.item_id)).all())
    answered = dict(s.execute(select(Answer.item_id, func.count()).join(Item, Item.id == Answer.item_id)
                              .where(*ordinary).group_by(Answer.item_id)).all())
    settled = set(s.scalars(select(Item.id).where(*ordinary, Item.settled.is_(True))).all())
    complete = sum(1 for i, n in counting.items() if n >= batch.raters or i in settled)
    given_up = sum(1 for i, n in answered.items()
                   if n >= SLOTS_PER_R * batch.raters and counting.get(i, 0) < batch.raters and i not in settled)
    out = {"items": n_items, "complete": complete, "given_up": given_up, "answers": sum(answered.values()),
           "target": n_items * batch.raters}
    if batch.stop_confidence is not None:      # adaptive stopping: the target is the most; settled items stop early
        out.update({"settled": len(settled), "min_raters": batch.min_raters,
                    "stop_confidence": batch.stop_confidence})
    return out


def judgements(s, batch: RatingBatch) -> dict:
    """What a batch cost its raters, in pairwise judgements: an answer to an item of K candidates counts K - 1 (a
    ranking of 4 is 3 judgements; a pairwise answer, a tie and "both bad" 1), a skip none. Gold items and flagged
    raters' answers count: they were spent. ``by_rater``: each rater's share; ``gold``: the part on gold items."""
    rows = s.execute(select(Answer.outcome, Item.images, Item.gold, User.name)
                     .join(Item, Item.id == Answer.item_id).join(User, User.id == Answer.rater_id)
                     .where(Item.batch_id == batch.id)).all()
    total, gold, by_rater = 0, 0, defaultdict(int)
    for outcome, images, gold_order, name in rows:
        n = 0 if outcome == "skip" else max(1, len(images) - 1)
        total += n
        gold += n if gold_order is not None else 0
        by_rater[name] += n
    return {"judgements": total, "gold": gold, "answers": len(rows), "by_rater": dict(sorted(by_rater.items()))}


def batch_figures(s, batch: RatingBatch, exclude: set[str]) -> dict:
    rows = [(a, i, n) for a, i, n in _load(s, [batch.id]) if i.gold is None and n not in exclude]
    alpha = {}
    for q in batch.questions:
        units: dict[tuple, list[int]] = defaultdict(list)
        for ans, item, _ in rows:
            handles = [v[0] for v in item.images]
            if q == "overall":
                prefs = preferences(ans.order, ans.outcome, handles)
            else:
                choice = (ans.extra or {}).get(q)        # a handle, or "tie"
                if choice is None or (choice != "tie" and choice not in handles):
                    continue
                prefs = (preferences([], "tie", handles) if choice == "tie" else
                         preferences([choice] + [h for h in handles if h != choice], "ranked", handles))
            for u, v in prefs.items():
                units[(item.id, u)].append(v)
        a = krippendorff_alpha(units)
        alpha[q] = None if a is None else round(a, 4)
    out = {"batch": batch.name, "kind": batch.kind, **batch_progress(s, batch), "alpha": alpha,
           "status": batch.status}
    if len(batch.folders) == 2:
        model = dict(s.execute(select(Image.id, Image.model).where(Image.batch_id == batch.id)).all())
        score, n = 0.0, 0
        for ans, item, _ in rows:
            if ans.outcome == "skip":
                continue
            if ans.outcome in ("tie", "both_bad"):
                score += 0.5
            else:
                best = ans.order[0]
                best = best[0] if isinstance(best, list) and len(best) == 1 else best
                score += 0.5 if isinstance(best, list) else float(model[best] == 0)
            n += 1
        lo, hi = wilson(score, n)
        out["comparison"] = {"a": batch.models[0], "b": batch.models[1], "n": n,
                             "a_win_rate": round(score / n, 4) if n else None, "ci95": [round(lo, 4), round(hi, 4)]}
    return out


def admin_figures(db: Database) -> dict:
    with db.read() as s:
        quality = rater_quality(s)
        exclude = {n for n, r in quality.items() if r["flagged"]}
        batches = s.scalars(select(RatingBatch).order_by(RatingBatch.id)).all()
        figures = [batch_figures(s, b, exclude) for b in batches]
    games = []
    for f in figures:
        c = f.get("comparison")
        if c and c["n"]:
            a, b = _label(c["a"]), _label(c["b"])
            # each answer a game: wins as the share, spread over n games
            games += [(a, b, c["a_win_rate"])] * c["n"]
    ranking = bradley_terry(games) if games else {}
    return {"batches": figures, "raters": quality,
            "bradley_terry": sorted(({"model": m, "strength": round(v, 4)} for m, v in ranking.items()),
                                    key=lambda r: -r["strength"])}


def _label(model) -> str:
    if isinstance(model, dict):
        return f"{model.get('checkpoint', '?')}@{model.get('step', '?')}"
    return str(model)[:16]


def rankings(db: Database, batch: str | None = None, include_flagged: bool = False) -> tuple[list[dict], list[str]]:
    """The answers as rankings (``difftrain pairs``' input: candidate ids best first, equal ones in a list), of
    one-folder batches, gold items and skips left out; and the candidates folders they refer to."""
    with db.read() as s:
        exclude = set() if include_flagged else flagged(s)
        q = select(RatingBatch).where(RatingBatch.name == batch) if batch else select(RatingBatch)
        batches = [b for b in s.scalars(q).all() if len(b.folders) == 1]
        out, folders = [], sorted({b.folders[0] for b in batches})
        for b in batches:
            cand = dict(s.execute(select(Image.id, Image.candidate).where(Image.batch_id == b.id)).all())
            for ans, item, name in _load(s, [b.id]):
                if item.gold is not None or ans.outcome == "skip" or name in exclude:
                    continue
                handles = [v[0] for v in item.images]
                order = ([[cand[h] for h in handles]] if ans.outcome in ("tie", "both_bad") else
                         [[cand[h] for h in g] if isinstance(g, list) else cand[g] for g in ans.order])
                out.append({"prompt_id": item.prompt_id, "rater": name, "order": order, "batch": b.name})
    return out, folders
