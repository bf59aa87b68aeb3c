"""Serving items to raters, recording answers, undo.

``next_item``: a rater's open assignment first (a reload shows the same item); else, with the batch's gold rate, a
gold item the rater has not seen; else the open batch's item with the most counting assignments that still needs
one (finishing items before starting new ones) and that the rater has not seen. R assignments of an item count;
one answered with a skip, or held by a flagged rater, stops counting and its slot reopens for another rater, up
to 2R slots an item (``SLOTS_PER_R``: an item every rater skips is given up, not served forever). The assignment
row takes the lowest free slot: two servers racing for the last slot of an item cannot both take it (unique
(item, slot)), and one rater cannot take an item twice (unique (item, rater)); the loser of a race tries the next
item. An assignment left unanswered for the TTL (``serve --assignment-ttl``, ``ASSIGNMENT_TTL`` by default) is
refused when answered (409) and released for others. In a batch with adaptive stopping (``stopping``), R is the
most an item gets: once its counting answers settle it, it is served no more (each answer, undo and change of a
rater's flag settles its items again).

``answer``: committed before the response (and so before the next item is served); an idempotency key makes a
retried post count once: the same key for the same (rater, assignment) returns the first outcome, the same key
for anything else is a 409 (never a silent "repeat" of another answer). ``undo``: the rater's last answer,
within ``UNDO_SECONDS``, is deleted and its item served again.

**Lock order** (PostgreSQL; SQLite's writers are serial): a transaction locks the rater's own assignment rows, then
the rater's user row, then item rows, several of them in item id order (``_update_flag`` sorts them). An item row is
locked ``FOR NO KEY UPDATE``, never ``FOR UPDATE``: inserting an answer or an assignment takes ``FOR KEY SHARE`` on
the item it names (the foreign key), which ``FOR UPDATE`` waits on. Two answers to one item, each holding the key
share of its insert and each asking ``FOR UPDATE``, were a deadlock; ``FOR NO KEY UPDATE`` does not wait on a key
share, so the second waits for the first to commit, then reads its answer. Other servers' stale assignments are
released in id order, skipping rows another transaction holds. Each of ``next_item``, ``answer`` and ``undo`` is run
again from its start when the database still aborts it as a deadlock victim or a serialization failure
(``db.retried``): a client never sees one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sqlalchemy import and_, delete, exists, func, select, update
from sqlalchemy.exc import IntegrityError

from difftrain_rate.db import SLOTS_PER_R, Answer, Assignment, Database, Item, RatingBatch, User, now, retried
from difftrain_rate.report import rater_flagged

ASSIGNMENT_TTL = 30 * 60
TTL_RANGE = (1, 7 * 24 * 3600)
UNDO_SECONDS = 10 * 60
from difftrain_rate.inputs import OUTCOMES  # noqa: E402 - one list for the API and the database


class Conflict(Exception):
    """The request does not fit the state (an assignment released or answered by another request)."""


@dataclass
class Served:
    assignment: int
    item: Item
    order: list[list[str]]       # the candidates as shown: each a list of frame image ids
    batch: RatingBatch
    progress: tuple[int, int]    # (answered by this rater in open batches, available to them in all)


_last_release = [0.0]


def slots(raters: int) -> int:
    """Slots an item may use in all: its R, and as many again for skips and flagged raters."""
    return SLOTS_PER_R * raters


def _release_stale(s, ttl: float) -> None:
    """Release assignments unanswered for the TTL (at most every few seconds per process: a scan of the open
    assignments' index, not of every one); an answer checks the age itself."""
    t = now()
    if t - _last_release[0] < min(5.0, ttl):
        return
    _last_release[0] = t
    stale = (select(Assignment.id).where(Assignment.answered.is_(False), Assignment.created_at < t - ttl)
             .order_by(Assignment.id).with_for_update(skip_locked=True))     # in id order; none another holds
    s.execute(delete(Assignment).where(Assignment.id.in_(stale)))


def _progress(s, rater: int) -> tuple[int, int]:
    done = s.scalar(select(func.count()).select_from(Answer).join(Item, Item.id == Answer.item_id)
                    .join(RatingBatch, RatingBatch.id == Item.batch_id)
                    .where(Answer.rater_id == rater, RatingBatch.status == "open")) or 0
    open_items = s.scalar(select(func.count()).select_from(Item).join(RatingBatch, RatingBatch.id == Item.batch_id)
                          .where(RatingBatch.status == "open", Item.gold.is_(None))) or 0
    return done, max(done, open_items)


def _served(s, a: Assignment, rater: int) -> Served:
    item = s.get(Item, a.item_id)
    views = {v[0]: v for v in item.images}
    return Served(a.id, item, [views[h] for h in a.order], s.get(RatingBatch, item.batch_id), _progress(s, rater))


def _choose(s, seen):
    """The open batch's ordinary item with the most counting assignments that still needs one (not settled) and has
    a free slot, that the rater has not seen: (item, counting) or None. Decided on the statement's snapshot."""
    taken = (select(func.count()).select_from(Assignment).where(Assignment.item_id == Item.id)
             .correlate(Item).scalar_subquery())
    counting = (select(func.count()).select_from(Assignment)
                .where(Assignment.item_id == Item.id, Assignment.counts.is_(True))
                .correlate(Item).scalar_subquery())
    return s.execute(select(Item, counting).join(RatingBatch, RatingBatch.id == Item.batch_id)
                     .where(RatingBatch.status == "open", Item.gold.is_(None), ~seen, Item.settled.is_(False),
                            counting < RatingBatch.raters, taken < SLOTS_PER_R * RatingBatch.raters)
                     .order_by(counting.desc(), Item.batch_id, Item.seq).limit(1)
                     # PostgreSQL: the chosen item's row stays locked to this transaction and the others skip
                     # it (no race for its slots); SQLite's writers are serial anyway. NO KEY UPDATE: an answer
                     # being inserted for the item (its key share) neither blocks nor hides it.
                     .with_for_update(of=Item, skip_locked=True, key_share=True)).first()


def held(db: Database, rater: int, ttl: float = ASSIGNMENT_TTL) -> Served | None:
    """The rater's open assignment in an open batch, within its TTL, or None: what a GET shows (it changes
    nothing; ``next_item`` takes one)."""
    with db.read() as s:
        a = s.scalar(select(Assignment).join(Item, Item.id == Assignment.item_id)
                     .join(RatingBatch, RatingBatch.id == Item.batch_id)
                     .where(Assignment.rater_id == rater, Assignment.answered.is_(False),
                            Assignment.created_at >= now() - ttl, RatingBatch.status == "open")
                     .order_by(Assignment.id).limit(1))
        return None if a is None else _served(s, a, rater)


@retried
def next_item(db: Database, rater: int, rng: random.Random | None = None, ttl: float = ASSIGNMENT_TTL
              ) -> Served | None:
    rng = rng or random.Random()
    for _attempt in range(20):
        try:
            with db.write() as s:
                _release_stale(s, ttl)
                a = s.scalar(select(Assignment).join(Item, Item.id == Assignment.item_id)
                             .join(RatingBatch, RatingBatch.id == Item.batch_id)
                             .where(Assignment.rater_id == rater, Assignment.answered.is_(False),
                                    RatingBatch.status == "open").order_by(Assignment.id).limit(1))
                if a is not None:
                    if a.created_at < now() - ttl:        # still held, so no one took it: the rater's again
                        a.created_at = now()
                    return _served(s, a, rater)
                seen = exists().where(and_(Assignment.item_id == Item.id, Assignment.rater_id == rater))
                item, slot = None, None
                batches = s.scalars(select(RatingBatch).where(RatingBatch.status == "open")).all()
                gold_rate = max((b.gold_rate for b in batches), default=0.0)
                gold = (select(Item).join(RatingBatch, RatingBatch.id == Item.batch_id)
                        .where(RatingBatch.status == "open", RatingBatch.gold_rate > 0, Item.gold.is_not(None), ~seen)
                        .order_by(func.random()).limit(1))
                if gold_rate and rng.random() < gold_rate:
                    item = s.scalar(gold)
                    slot = rater          # gold: every rater once; the slot is the rater's own
                if item is None:
                    row = _choose(s, seen)
                    if row is not None:
                        item = row[0]
                        # Counted again now that the item's row is locked: the choice was made on the statement's
                        # snapshot, and (PostgreSQL, read committed) another server may have committed an
                        # assignment of this item since, without touching the row the lock re-checks.
                        raters = s.get(RatingBatch, item.batch_id).raters
                        held = s.execute(select(Assignment.slot, Assignment.counts)
                                         .where(Assignment.item_id == item.id)).all()
                        used = {h.slot for h in held}
                        slot = next(k for k in range(len(used) + 1) if k not in used)
                        if slot >= slots(raters) or sum(1 for h in held if h.counts) >= raters:
                            raise IntegrityError("the item's slots filled since it was chosen", None, None)
                    elif gold_rate:               # nothing else left: the gold items not seen yet
                        item, slot = s.scalar(gold), rater
                    if item is None:
                        return None
                order = [v[0] for v in item.images]
                rng.shuffle(order)                            # sides and order randomised per assignment
                flagged = bool(s.scalar(select(User.flagged).where(User.id == rater)))
                a = Assignment(item_id=item.id, rater_id=rater, slot=slot, order=order, answered=False,
                               created_at=now(), counts=not flagged)
                s.add(a)
                s.flush()
                return _served(s, a, rater)
        except IntegrityError:
            continue          # another server took the slot (or this rater's other tab took the item): again
    raise Conflict("could not take an item after 20 tries: too many concurrent raters on too few items")


@retried
def answer(db: Database, rater: int, assignment: int, key: str, order: list, outcome: str, extra: dict,
           seconds: float | None = None, ttl: float = ASSIGNMENT_TTL) -> dict:
    """Record an answer: ``order`` lists the candidates' handles best first (a sub-list: equal); for a pairwise
    item ``outcome`` may be tie, both_bad or skip with an empty order. Returns {"answer": id, "repeat": bool}."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r}: expected one of {OUTCOMES}")
    if not key or len(key) > 100:
        raise ValueError("an idempotency key of 1-100 characters is required")
    expired = False
    try:
        with db.write() as s:
            prior = s.scalar(select(Answer).where(Answer.idempotency_key == key))
            if prior is not None:
                return _repeat(prior, rater, assignment, key)
            a = s.get(Assignment, assignment)
            if a is None or a.rater_id != rater:
                raise Conflict("no such assignment of yours (it may have expired and been released)")
            if a.answered:
                raise Conflict("this item is already answered")
            if a.created_at < now() - ttl:
                s.delete(a)                 # released now (committed), then refused below
                expired = True
            else:
                handles = set(a.order)
                flat = [h for x in order for h in (x if isinstance(x, list) else [x])]
                if outcome == "ranked":
                    if sorted(flat) != sorted(handles):
                        raise ValueError("the order must name each candidate of the item once")
                elif flat:
                    raise ValueError(f"outcome {outcome!r} takes no order")
                ans = Answer(assignment_id=a.id, item_id=a.item_id, rater_id=rater, idempotency_key=key, order=order,
                             outcome=outcome, extra=extra or {},
                             seconds=seconds if seconds is not None else now() - a.created_at)
                a.answered = True
                if outcome == "skip":
                    a.counts = False           # the slot reopens for another rater
                s.add(ans)
                s.flush()
                if s.get(Item, a.item_id).gold is not None:
                    _update_flag(s, rater)
                else:
                    _settle(s, a.item_id)
                return {"answer": ans.id, "repeat": False}
    except IntegrityError:
        with db.read() as s:        # the same key posted twice at once: the first one won
            prior = s.scalar(select(Answer).where(Answer.idempotency_key == key))
        if prior is not None:
            return _repeat(prior, rater, assignment, key)
        raise Conflict("this item is already answered") from None
    assert expired                  # every other path returned or raised inside the transaction
    raise Conflict(f"this assignment expired ({ttl:g} s unanswered) and was released: load the next item")


def _repeat(prior: Answer, rater: int, assignment: int, key: str) -> dict:
    """The first outcome of a retried post; a key already used for another (rater, assignment) is a conflict."""
    if prior.rater_id != rater or prior.assignment_id != assignment:
        raise Conflict(f"idempotency key {key!r} was used for another answer: send a new key with each answer "
                       "(this one was not stored)")
    return {"answer": prior.id, "repeat": True}


def _lock_item(s, item_id: str) -> Item:
    """The item's row, locked FOR NO KEY UPDATE (PostgreSQL; the lock order in the module docstring)."""
    return s.scalar(select(Item).where(Item.id == item_id).with_for_update(key_share=True)
                    .execution_options(populate_existing=True))


def _room(s, item: Item, but: int | None = None) -> bool:
    """Whether the item (its row locked) has fewer assignments counting toward R than its batch's R, leaving out
    assignment ``but``: a gold item always has room (every rater once)."""
    if item.gold is not None:
        return True
    raters = s.scalar(select(RatingBatch.raters).where(RatingBatch.id == item.batch_id))
    counting = s.scalar(select(func.count()).select_from(Assignment)
                        .where(Assignment.item_id == item.id, Assignment.counts.is_(True), Assignment.id != (but or 0)))
    return counting < raters


def _update_flag(s, rater: int) -> None:
    """The rater's flag from their gold answers; when it changes, their assignments stop (or start again) counting
    toward R, skipped ones staying out. Unflagged, an assignment counts again only where its item has room: its slot
    may have gone to another rater meanwhile, and an item never has more than R assignments that count."""
    flag = rater_flagged(s, rater)
    user = s.get(User, rater)
    if user is None or bool(user.flagged) == flag:
        return
    user.flagged = flag
    skipped = select(Answer.assignment_id).where(Answer.rater_id == rater, Answer.outcome == "skip")
    mine = s.execute(select(Assignment.id, Assignment.item_id)
                     .where(Assignment.rater_id == rater, Assignment.id.not_in(skipped))
                     .order_by(Assignment.id).with_for_update(key_share=True)).all()
    if flag:
        s.execute(update(Assignment).where(Assignment.id.in_([a.id for a in mine])).values(counts=False))
    # Items in id order (the lock order): unflagged, each is locked and recounted; each is settled again.
    for a in sorted(mine, key=lambda a: a.item_id):
        if flag:
            _settle(s, a.item_id)
            continue
        item = _lock_item(s, a.item_id)
        if _room(s, item, but=a.id):
            s.execute(update(Assignment).where(Assignment.id == a.id).values(counts=True))
        _settle(s, item.id, locked=item)


def _settle(s, item_id: str, locked: Item | None = None) -> None:
    """Whether the item's counting answers settle it (a batch with adaptive stopping; ``stopping.settled``). The
    item's row is locked first (PostgreSQL, FOR NO KEY UPDATE), and only in a batch with adaptive stopping: two
    answers to one item settle it one after the other, the second reading the first's answer."""
    from difftrain_rate.stopping import settled

    batch = s.scalar(select(RatingBatch).join(Item, Item.batch_id == RatingBatch.id).where(Item.id == item_id))
    if batch.stop_confidence is None:
        return
    item = locked or _lock_item(s, item_id)
    if item.gold is not None:
        return
    rows = s.execute(select(Answer.order, Answer.outcome).join(Assignment, Assignment.id == Answer.assignment_id)
                     .where(Answer.item_id == item_id, Assignment.counts.is_(True))).all()
    item.settled = settled([(r.order, r.outcome) for r in rows], [v[0] for v in item.images], batch.min_raters or 1,
                           batch.stop_confidence)


@retried
def undo(db: Database, rater: int) -> str | None:
    """Delete the rater's last answer (within ``UNDO_SECONDS``) and reopen its assignment; the item id or None."""
    with db.write() as s:
        last = s.scalar(select(Answer).where(Answer.rater_id == rater).order_by(Answer.id.desc()).limit(1))
        if last is None or last.created_at < now() - UNDO_SECONDS:
            return None
        a = s.get(Assignment, last.assignment_id)
        gold = s.get(Item, a.item_id).gold is not None
        s.delete(last)
        # Reopened: served next (before any other open assignment of the rater); the rater's own rows first.
        s.execute(delete(Assignment).where(Assignment.rater_id == rater, Assignment.answered.is_(False),
                                           Assignment.id != a.id))
        s.flush()
        if gold:
            a.counts = not s.get(User, rater).flagged
            _update_flag(s, rater)
        else:
            # Reopened, it counts again if its rater is not flagged and the item has room: a skip's slot, or a
            # flagged rater's, may have gone to another rater since.
            a.counts = not s.get(User, rater).flagged and _room(s, _lock_item(s, a.item_id), but=a.id)
        a.answered = False
        a.created_at = now()
        if not gold:
            _settle(s, a.item_id)
        return a.item_id
