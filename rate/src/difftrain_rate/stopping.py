"""Adaptive stopping: an item stops being served once its answers are clear, so that raters' time goes to the items
they disagree on.

A batch with a stopping confidence ``c`` (``import --stop-confidence C --min-raters M``; ``raters`` R is then the
most an item gets) settles an item once it has at least M answers that count (no skip, no flagged rater) and every
pair of its candidates is decided: the Wilson score lower bound (one-sided, at ``c``) of the share of answers
preferring the pair's majority side exceeds 1/2, an answer calling the pair equal (a tie, both bad, or the two in
one group of a ranking) counting half to each side. Two answers that agree settle a pair at c = 0.9 (lower bound
0.55), not at c = 0.95 (three do); a pair the raters split on, or call equal, is not settled and the item is served
up to R. Gold items are not concerned (every rater sees them once, as before).
"""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import combinations
from statistics import NormalDist

from difftrain_rate.stats import preferences

CONFIDENCE_RANGE = (0.5, 0.999)      # exclusive below (a bound at 1/2 says nothing), inclusive above


def wilson_lower(successes: float, n: float, confidence: float) -> float:
    """The one-sided Wilson score lower bound of a proportion at ``confidence`` (0 for no trials)."""
    if n <= 0:
        return 0.0
    z = NormalDist().inv_cdf(confidence)
    p = successes / n
    denom = 1.0 + z * z / n
    centre = p + z * z / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - margin) / denom


def pair_tallies(answers: list[tuple[list, str]], handles: list[str]) -> dict[tuple[str, str], list[float]]:
    """(x, y) -> [answers preferring x, answers preferring y, answers calling them equal]."""
    tally: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for order, outcome in answers:
        for pair, v in preferences(order, outcome, handles).items():
            tally[pair][0 if v > 0 else 1 if v < 0 else 2] += 1
    return tally


def settled(answers: list[tuple[list, str]], handles: list[str], min_raters: int, confidence: float) -> bool:
    """Whether an item's counting ``answers`` ((order, outcome) each; skips are ignored) settle it."""
    answers = [(o, oc) for o, oc in answers if oc != "skip"]
    if len(answers) < max(1, min_raters):
        return False
    tally = pair_tallies(answers, handles)
    for pair in combinations(sorted(handles), 2):
        a, b, eq = tally.get(pair, (0.0, 0.0, 0.0))
        n = a + b + eq
        if wilson_lower(max(a, b) + eq / 2, n, confidence) <= 0.5:
            return False
    return True


def check_settings(raters: int, min_raters: int | None, confidence: float | None) -> tuple[int | None, float | None]:
    """The batch's stopping settings, checked (``RateError`` naming the option): (min_raters, confidence), both None
    for a batch of fixed R."""
    from difftrain_rate.errors import RateError

    if confidence is None:
        if min_raters is not None:
            raise RateError(f"--min-raters {min_raters}: only with --stop-confidence (a batch of fixed R asks R)")
        return None, None
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not (
            CONFIDENCE_RANGE[0] < confidence <= CONFIDENCE_RANGE[1]):
        raise RateError(f"--stop-confidence {confidence!r}: expected a number in ({CONFIDENCE_RANGE[0]}, "
                        f"{CONFIDENCE_RANGE[1]}]")
    m = min(2, raters) if min_raters is None else min_raters
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= raters:
        raise RateError(f"--min-raters {min_raters!r}: expected 1..{raters} (--raters, the most an item gets)")
    return m, float(confidence)
