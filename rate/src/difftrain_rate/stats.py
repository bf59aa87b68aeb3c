"""The admin's figures: preferences from answers, agreement, Krippendorff's alpha, gold scores, win rates and a
Bradley–Terry ranking of checkpoints. Pure Python: the app needs no numpy.

An answer is turned into pairwise preferences between the item's candidates: for each two candidates x < y
(by handle), +1 when x is ranked above y, -1 below, 0 equal (a tie or "both bad" makes every pair equal; a skip
gives none). Those are the units of agreement: (item, x, y) rated by several raters.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from itertools import combinations


def preferences(order: list, outcome: str, handles: list[str]) -> dict[tuple[str, str], int]:
    """(x, y) with x < y -> +1 / -1 / 0 for one answer (see the module docstring)."""
    if outcome == "skip":
        return {}
    pairs = list(combinations(sorted(handles), 2))
    if outcome in ("tie", "both_bad"):
        return {p: 0 for p in pairs}
    pos = {h: i for i, g in enumerate(order) for h in (g if isinstance(g, list) else [g])}
    return {(x, y): (1 if pos[x] < pos[y] else -1 if pos[y] < pos[x] else 0) for x, y in pairs}


def krippendorff_alpha(units: dict, level: str = "nominal") -> float | None:
    """Krippendorff's alpha over ``units`` (unit -> the values its raters gave; units with fewer than two
    values are not pairable and are left out). ``nominal`` or ``interval`` (squared differences). None when
    undefined (no pairable unit, or a single value used throughout: no variation to agree on)."""
    if level not in ("nominal", "interval"):
        raise ValueError(f"level {level!r}: expected 'nominal' or 'interval'")

    def delta(a, b) -> float:
        return float(a != b) if level == "nominal" else float(a - b) ** 2

    coincidence: dict[tuple, float] = defaultdict(float)
    for values in units.values():
        vals = [v for v in values if v is not None]
        m = len(vals)
        if m < 2:
            continue
        for i, a in enumerate(vals):
            for j, b in enumerate(vals):
                if i != j:
                    coincidence[(a, b)] += 1.0 / (m - 1)
    totals: dict = defaultdict(float)
    for (a, _), w in coincidence.items():
        totals[a] += w
    n = sum(totals.values())
    if n <= 1:
        return None
    observed = sum(w * delta(a, b) for (a, b), w in coincidence.items())
    expected = sum(totals[a] * totals[b] * delta(a, b) for a in totals for b in totals) / (n - 1)
    if expected == 0:
        return None
    return 1.0 - observed / expected


def majority(values: list[int]) -> int | None:
    """The most common value; None on a tie for the most."""
    if not values:
        return None
    (top, n), *rest = Counter(values).most_common()
    return None if rest and rest[0][1] == n else top


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% score interval for a share (ties counted as half a success)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def bradley_terry(games: list[tuple[str, str, float]], iterations: int = 500, prior: float = 0.5) -> dict[str, float]:
    """Strengths (log scale, mean 0) of players from games (a, b, score of a: 1 win, 0 loss, 0.5 tie), by the
    minorization-maximization updates (Hunter 2004); ``prior`` games won and lost against each opponent keep a
    player who always won finite."""
    players = sorted({p for a, b, _ in games for p in (a, b)})
    if len(players) < 2:
        return {p: 0.0 for p in players}
    wins: dict[str, float] = defaultdict(float)
    count: dict[tuple[str, str], float] = defaultdict(float)
    for a, b, s in games:
        wins[a] += s
        wins[b] += 1 - s
        count[(a, b)] += 1
        count[(b, a)] += 1
    for a, b in combinations(players, 2):
        wins[a] += prior
        wins[b] += prior
        count[(a, b)] += 2 * prior
        count[(b, a)] += 2 * prior
    strength = {p: 1.0 for p in players}
    for _ in range(iterations):
        new = {}
        for p in players:
            denom = sum(count[(p, q)] / (strength[p] + strength[q]) for q in players if q != p and count[(p, q)])
            new[p] = wins[p] / denom if denom else strength[p]
        g = math.exp(sum(math.log(v) for v in new.values()) / len(new))
        new = {p: v / g for p, v in new.items()}
        done = max(abs(new[p] - strength[p]) for p in players) < 1e-10
        strength = new
        if done:
            break
    return {p: math.log(v) for p, v in strength.items()}


def gold_score(answer_prefs: dict[tuple[str, str], int], gold_prefs: dict[tuple[str, str], int]) -> tuple[float, int]:
    """(agreement, units) of one answer with the gold order: a matching preference scores 1, an equal vote where
    gold has an order 0.5, the opposite 0."""
    score, n = 0.0, 0
    for unit, g in gold_prefs.items():
        if unit not in answer_prefs or g == 0:
            continue
        v = answer_prefs[unit]
        score += 1.0 if v == g else 0.5 if v == 0 else 0.0
        n += 1
    return score, n
