"""Exports: every answer as a table (CSV or Parquet, for analysis) and the answers as rankings (JSONL, the input
of ``difftrain pairs``; ``difftrain rate export`` turns them into the pairs file directly)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from sqlalchemy import select

from difftrain_rate.db import Answer, Database, Image, Item, RatingBatch, User
from difftrain_rate.errors import RateError
from difftrain_rate.report import flagged, rankings

COLUMNS = ["answer", "batch", "item", "prompt_id", "prompt", "task", "rater", "flagged", "gold", "outcome", "order",
           "extra", "seconds", "created_at"]


def answer_rows(db: Database) -> list[dict]:
    with db.read() as s:
        bad = flagged(s)
        rows = s.execute(select(Answer, Item, User.name, RatingBatch.name)
                         .join(Item, Item.id == Answer.item_id).join(User, User.id == Answer.rater_id)
                         .join(RatingBatch, RatingBatch.id == Item.batch_id).order_by(Answer.id)).all()
        cand = dict(s.execute(select(Image.id, Image.candidate)).all())
    out = []
    for a, item, rater, batch in rows:
        order = [[cand[h] for h in g] if isinstance(g, list) else cand[g] for g in a.order]
        out.append({"answer": a.id, "batch": batch, "item": item.id, "prompt_id": item.prompt_id, "prompt": item.prompt,
                    "task": item.task, "rater": rater, "flagged": rater in bad, "gold": item.gold is not None,
                    "outcome": a.outcome, "order": json.dumps(order), "extra": json.dumps(a.extra),
                    "seconds": round(a.seconds, 3), "created_at": a.created_at})
    return out


FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def cell(value):
    """A CSV cell a spreadsheet shows as text: a string starting with a formula character gets a leading ' (OWASP's
    CSV injection rule); numbers stay numbers."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def answers_csv(db: Database) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows({k: cell(v) for k, v in row.items()} for row in answer_rows(db))
    return buf.getvalue()


def write_answers(db: Database, out: str | Path) -> int:
    p = Path(out)
    rows = answer_rows(db)
    if p.suffix == ".csv":
        p.write_text(answers_csv(db))
    elif p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows) if rows else pa.table({c: [] for c in COLUMNS}), p)
    else:
        raise RateError(f"--out {p}: expected a .csv or .parquet file")
    return len(rows)


def write_rankings(db: Database, out: str | Path, batch: str | None = None, include_flagged: bool = False) -> dict:
    rows, folders = rankings(db, batch, include_flagged)
    if batch is not None and not folders:
        raise RateError(f"--batch {batch!r}: no such one-folder batch")
    p = Path(out)
    tmp = p.with_name(p.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tmp.replace(p)
    return {"rankings": len(rows), "folders": folders, "out": str(p)}
