"""An HTML report of a training run directory (``difftrain train --run-dir RUN``).

``write_report(RUN)`` reads ``RUN/metrics.jsonl`` (required), ``RUN/events.jsonl``, ``RUN/samples/*.png``
and ``RUN/config.toml`` (all optional) and writes two files to ``RUN/report`` (or ``out``):

* ``report.png``: four panels: loss (and per-task losses) vs step; throughput and MFU vs step;
  the step-time breakdown (data wait, forward+backward, optimizer, checkpoint stall) vs step; and a
  timeline vs wall-clock hours with the step reached over time and the run's events (restarts,
  checkpoints, skips, rollbacks, spikes, stragglers, preemptions, hangs) marked on it.
* ``report.html``: one self-contained page (images as base64 data URIs) with a summary table, the
  plots, the newest sample grids, the last events and the config.

A run that resumed from a checkpoint appends rows whose step is at or below one written before; the
step-axis panels use the last row written for each step, the timeline shows the drop. Lines that are
not JSON objects (a line cut short by a killed process) are skipped and counted (``bad_lines``).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from difftrain.errors import UserError
from difftrain.train.metrics import read_jsonl

MAX_EVENTS_SHOWN = 50
MAX_SAMPLES = 3
SAMPLE_MAX_BYTES = 2_000_000     # larger sample grids are downscaled before embedding
SAMPLE_MAX_SIDE = 1536
# Events drawn as full-height vertical lines (rare, run-wide); the rest are markers at (time, step).
VLINE_STYLE = {
    "start": dict(color="0.55", ls="-", lw=1.0),
    "restart": dict(color="tab:red", ls="-", lw=1.5),
    "resume": dict(color="tab:green", ls=":", lw=1.2),
    "preempt": dict(color="tab:orange", ls="--", lw=1.5),
    "hang": dict(color="tab:purple", ls="-.", lw=1.5),
    "rollback": dict(color="tab:brown", ls="--", lw=1.2),
    "checkpoint_failed": dict(color="black", ls=":", lw=1.2),
}
MARKER_STYLE = {
    "checkpoint": dict(color="tab:blue", marker="s", s=22),
    "skip": dict(color="tab:red", marker="x", s=30),
    "spike": dict(color="tab:orange", marker="^", s=30),
    "straggler": dict(color="tab:purple", marker="v", s=26),
}
OTHER_MARKER = dict(color="0.4", marker=".", s=30)
STEP_TIME_PARTS = (("data_s", "data wait"), ("fwd_bwd_s", "forward+backward"), ("optim_s", "optimizer"),
                   ("checkpoint_stall_s", "checkpoint stall"))


@dataclass
class RunData:
    """What a run directory holds, parsed. ``rows`` is metrics.jsonl in the order written."""
    run_dir: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    bad_metrics: int = 0
    bad_events: int = 0
    samples: list[Path] = field(default_factory=list)
    config: str | None = None

    @property
    def bad_lines(self) -> int:
        return self.bad_metrics + self.bad_events


# --- reading ------------------------------------------------------------------------------------------
def _num(v: Any) -> float | None:
    """A finite float, or None for a missing / non-numeric / non-finite value."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _step(v: Any) -> int | None:
    x = _num(v)
    return int(x) if x is not None and x == int(x) else None


def read_run(run_dir: str | Path) -> RunData:
    """Parse a run directory; UserError if it is not one."""
    run_dir = Path(run_dir)
    expected = "a run directory written by 'difftrain train' (with metrics.jsonl)"
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such directory; expected {expected}")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl there; expected {expected}")
    data = RunData(run_dir)
    rows, data.bad_metrics = read_jsonl(metrics)
    for r in rows:                       # a row without an integer step cannot be placed: count it as bad
        s = _step(r.get("step"))
        if s is None:
            data.bad_metrics += 1
        else:
            data.rows.append({**r, "step": s})
    data.events, data.bad_events = read_jsonl(run_dir / "events.jsonl")
    samples_dir = run_dir / "samples"
    if samples_dir.is_dir():
        data.samples = sorted(p for p in samples_dir.glob("*.png") if p.is_file())[-MAX_SAMPLES:]
    config = run_dir / "config.toml"
    if config.is_file():
        data.config = config.read_text(encoding="utf-8", errors="replace")
    return data


# --- derived series and numbers -----------------------------------------------------------------------
def last_row_per_step(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, sorted by step: the last one written (replayed steps replace the earlier ones)."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in rows:
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows where ``key`` is a finite number."""
    pts = [(r["step"], _num(r.get(key))) for r in rows]
    pts = [(s, v) for s, v in pts if v is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def _max_of(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [v for v in (_num(r.get(key)) for r in rows) if v is not None]
    return max(vals) if vals else None


def _mean(vals: list[float]) -> float | None:
    return statistics.fmean(vals) if vals else None


def _kind(e: dict[str, Any]) -> str:
    k = e.get("kind")
    return k if isinstance(k, str) and k else "unknown"


def summarize(data: RunData) -> dict[str, Any]:
    """The numbers of the summary table."""
    rows, events = data.rows, data.events
    kinds: dict[str, int] = {}
    for e in events:
        kinds[_kind(e)] = kinds.get(_kind(e), 0) + 1

    # Resumes: steps going back in metrics.jsonl; steps redone estimated with the logging interval.
    regressions, redone = 0, 0
    diffs = [b["step"] - a["step"] for a, b in zip(rows, rows[1:]) if b["step"] > a["step"]]
    interval = int(statistics.median(diffs)) if diffs else 1
    for a, b in zip(rows, rows[1:]):
        if b["step"] <= a["step"]:
            regressions += 1
            redone += a["step"] - b["step"] + interval
    # Each source is a lower bound on the count (an event log or a counter may be missing or reset).
    restarts = max(kinds.get("restart", 0), int(_max_of(rows, "restarts") or 0), regressions)
    skipped = max(kinds.get("skip", 0), int(_max_of(rows, "skipped_steps") or 0))

    # Checkpoint stalls: from the checkpoint events, else from the nonzero per-step stalls.
    stalls = [v for e in events if _kind(e) == "checkpoint"
              for v in [_num(e.get("stall_s", e.get("seconds")))] if v is not None]
    if not stalls:
        stalls = [v for v in (_num(r.get("checkpoint_stall_s")) for r in rows) if v]

    times = [t for t in (_num(x.get("time")) for x in rows + events) if t is not None]
    wall_s = max(times) - min(times) if len(times) >= 2 else _max_of(rows, "train_seconds")

    fractions = []
    for r in rows:
        d, s = _num(r.get("data_s")), _num(r.get("step_s"))
        if d is not None and s is not None and d + s > 0:
            fractions.append(d / (d + s))
    losses = [v for v in (_num(r.get("loss")) for r in rows) if v is not None]
    vals = [(r["step"], _num(r.get("val_loss")), _num(r.get("val_loss_ema"))) for r in rows
            if _num(r.get("val_loss")) is not None]
    return {
        "last_val_loss": list(vals[-1]) if vals else None,      # [step, weights, EMA]
        "steps": max((r["step"] for r in rows), default=0),
        "last_step": rows[-1]["step"] if rows else 0,
        "rows": len(rows),
        "wall_s": wall_s,
        "restarts": restarts,
        "steps_redone": redone,
        "skipped_steps": skipped,
        "rollbacks": kinds.get("rollback", 0),
        "checkpoints": kinds.get("checkpoint", 0),
        "checkpoints_failed": kinds.get("checkpoint_failed", 0),
        "stall_mean_s": _mean(stalls),
        "stall_max_s": max(stalls) if stalls else None,
        "data_wait_fraction": _mean(fractions),
        "samples_per_s": _mean([v for v in (_num(r.get("samples_per_s")) for r in rows) if v is not None]),
        "last_loss": losses[-1] if losses else None,
        "data_errors": _max_of(rows, "data_errors"),
        "mem_gb_max": _max_of(rows, "mem_gb"),
        "events": len(events),
        "event_kinds": kinds,
        "bad_lines": data.bad_lines,
    }


# --- plots --------------------------------------------------------------------------------------------
def _smooth(y: list[float], window: int) -> list[float]:
    """Centered moving average (shorter at the ends)."""
    out, n, h = [], len(y), window // 2
    prefix = [0.0]
    for v in y:
        prefix.append(prefix[-1] + v)
    for i in range(n):
        lo, hi = max(0, i - h), min(n, i + h + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def _no_data(ax, title: str, notes: list[str], what: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5", fontsize=14)
    ax.set_xticks([])
    ax.set_yticks([])
    notes.append(f"{title}: no data ({what} missing in every row)")


def _plot_loss(ax, rows: list[dict[str, Any]], notes: list[str]) -> None:
    title = "loss"
    curves: list[tuple[str, list[int], list[float]]] = []
    s, v = _series(rows, "loss")
    if s:
        curves.append(("loss", s, v))
    task_keys = sorted({k for r in rows for k in r if k.startswith("loss_")})
    for k in task_keys:
        ks, kv = _series(rows, k)
        if ks:
            curves.append((k, ks, kv))
    tasks = sorted({r["task"] for r in rows if isinstance(r.get("task"), str)})
    if not task_keys and len(tasks) > 1:     # one task a step: split the loss by the row's task
        for t in tasks:
            ts, tv = _series([r for r in rows if r.get("task") == t], "loss")
            if ts:
                curves.append((f"loss ({t})", ts, tv))
    if not curves:
        return _no_data(ax, title, notes, "loss")
    for i, (label, xs, ys) in enumerate(curves):
        color = f"C{i}"
        if len(ys) > 50:                     # noisy: faint raw values, a smoothed line on top
            ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
            ax.plot(xs, _smooth(ys, max(5, len(ys) // 50)), color=color, lw=1.6, label=f"{label} (smoothed)")
        else:
            faint = label == "loss" and len(curves) > 1     # the per-task lines carry the detail
            ax.plot(xs, ys, color=color, lw=1.0 if faint else 1.4, alpha=0.45 if faint else 1.0,
                    marker="." if len(ys) < 30 else None, label=label)
    for j, key in enumerate(("val_loss", "val_loss_ema")):      # the validation loss: fixed noise and t
        vs, vv = _series(rows, key)
        if vs:
            ax.plot(vs, vv, color="k", ls="-" if j == 0 else "--", marker="o", ms=3, lw=1.4,
                    label=key.replace("_", " ") + " (held out)")
            curves.append((key, vs, vv))
    if all(y > 0 for _, _, ys in curves for y in ys):
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _plot_throughput(ax, rows: list[dict[str, Any]], notes: list[str]) -> None:
    title = "throughput"
    key, label = "samples_per_s", "samples/s"
    s, v = _series(rows, key)
    if not s:
        key, label = "tokens_per_s", "tokens/s"
        s, v = _series(rows, key)
    ms, mv = _series(rows, "mfu")
    if not s and not ms:
        return _no_data(ax, title, notes, "samples_per_s, tokens_per_s and mfu")
    handles = []
    if s:
        handles += ax.plot(s, v, color="tab:blue", lw=1.2, label=label)
        ax.set_ylabel(label)
    if ms:
        ax2 = ax.twinx() if s else ax
        handles += ax2.plot(ms, mv, color="tab:green", lw=1.0, alpha=0.8, label="MFU")
        ax2.set_ylabel("MFU")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)


def _plot_step_time(ax, rows: list[dict[str, Any]], notes: list[str]) -> None:
    title = "step time breakdown"
    present = {k for r in rows for k in r if _num(r.get(k)) is not None}
    parts = list(STEP_TIME_PARTS)
    if not present & {"fwd_bwd_s", "optim_s"}:     # no split of the compute time: show step_s whole
        parts.insert(1, ("step_s", "compute (step_s)"))
    parts = [(k, label) for k, label in parts if k in present]
    if not parts:
        return _no_data(ax, title, notes, "data_s, step_s, fwd_bwd_s, optim_s and checkpoint_stall_s")
    rows = [r for r in rows if any(_num(r.get(k)) is not None for k, _ in parts)]
    steps = [r["step"] for r in rows]
    stacks = [[_num(r.get(k)) or 0.0 for r in rows] for k, _ in parts]
    colors = {"data_s": "tab:red", "step_s": "tab:blue", "fwd_bwd_s": "tab:blue", "optim_s": "tab:cyan",
              "checkpoint_stall_s": "tab:gray"}
    ax.stackplot(steps, *stacks, labels=[label for _, label in parts], colors=[colors[k] for k, _ in parts],
                 alpha=0.75, step="mid" if len(steps) > 1 else None)
    ax.set_title(title + " (stacked)")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(alpha=0.3)


def _plot_timeline(ax, rows: list[dict[str, Any]], events: list[dict[str, Any]], notes: list[str]) -> None:
    title = "timeline"
    timed_rows = sorted(((t, r["step"]) for r in rows for t in [_num(r.get("time"))] if t is not None),
                        key=lambda p: p[0])
    timed_events = [(t, e) for e in events for t in [_num(e.get("time"))] if t is not None]
    if len(events) > len(timed_events):
        notes.append(f"timeline: {len(events) - len(timed_events)} event(s) without a time are not drawn")
    if timed_rows or timed_events:
        t0 = min([t for t, _ in timed_rows] + [t for t, _ in timed_events])
        xlabel = "hours since the first row/event"
    else:
        # No wall-clock times: the step line over the trainer's own clock, if it logs one.
        timed_rows = sorted(((t, r["step"]) for r in rows for t in [_num(r.get("train_seconds"))] if t is not None),
                            key=lambda p: p[0])
        if not timed_rows:
            return _no_data(ax, title, notes, "time (and train_seconds)")
        t0, xlabel = 0.0, "hours of training (train_seconds; no wall-clock times logged)"
    hours = lambda t: (t - t0) / 3600.0                                     # noqa: E731
    if timed_rows:
        ax.plot([hours(t) for t, _ in timed_rows], [s for _, s in timed_rows], color="k", lw=1.3,
                label="step reached", drawstyle="steps-post", zorder=3)
    labelled: set[str] = set()
    # Events without a step go at the bottom of the axes.
    bottom = ax.get_xaxis_transform()
    for t, e in sorted(timed_events, key=lambda p: p[0]):
        kind = _kind(e)
        label = None if kind in labelled else kind
        labelled.add(kind)
        if kind in VLINE_STYLE:
            ax.axvline(hours(t), label=label, zorder=2, **VLINE_STYLE[kind])
            continue
        style = MARKER_STYLE.get(kind, OTHER_MARKER)
        step = _num(e.get("step"))
        if step is None:
            ax.scatter([hours(t)], [0.03], transform=bottom, label=label, zorder=4, **style)
        else:
            ax.scatter([hours(t)], [step], label=label, zorder=4, **style)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("step")
    # Outside the axes: many markers, no free corner.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.grid(alpha=0.3)


def plot_run(data: RunData, notes: list[str]) -> bytes:
    """The four panels in one figure, as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_tp, ax_time, ax_line = fig.subplots(2, 2).flat
    by_step = last_row_per_step(data.rows)
    _plot_loss(ax_loss, by_step, notes)
    _plot_throughput(ax_tp, by_step, notes)
    _plot_step_time(ax_time, by_step, notes)
    _plot_timeline(ax_line, data.rows, data.events, notes)
    fig.suptitle(f"run {data.run_dir.resolve().name}")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# --- HTML ---------------------------------------------------------------------------------------------
def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _sample_png(path: Path) -> bytes:
    """A sample grid's PNG bytes, downscaled if it is large (the page embeds it)."""
    raw = path.read_bytes()
    if len(raw) <= SAMPLE_MAX_BYTES:
        return raw
    from PIL import Image
    with Image.open(io.BytesIO(raw)) as im:
        im.thumbnail((SAMPLE_MAX_SIDE, SAMPLE_MAX_SIDE))
        buf = io.BytesIO()
        im.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    h, rem = divmod(int(round(seconds)), 3600)
    return f"{h}h {rem // 60:02d}m {rem % 60:02d}s ({seconds / 3600:.2f} h)"


def _summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    steps = str(s["steps"]) + (f" (last row: step {s['last_step']})" if s["last_step"] != s["steps"] else "")
    stall = "–" if s["stall_mean_s"] is None else f"{s['stall_mean_s']:.3g} s / {s['stall_max_s']:.3g} s"
    frac = "–" if s["data_wait_fraction"] is None else f"{100 * s['data_wait_fraction']:.1f} %"
    rows = [
        ("steps reached", steps),
        ("metric rows", str(s["rows"])),
        ("wall time", _fmt_duration(s["wall_s"])),
        ("restarts", str(s["restarts"])),
        ("steps redone after resumes (approx.)", str(s["steps_redone"])),
        ("skipped steps", str(s["skipped_steps"])),
        ("rollbacks", str(s["rollbacks"])),
        ("checkpoints", str(s["checkpoints"])),
        ("failed checkpoints", str(s["checkpoints_failed"])),
        ("checkpoint stall mean / max", stall),
        ("mean data-wait fraction", frac),
        ("mean samples/s", _fmt(s["samples_per_s"])),
        ("last loss", _fmt(s["last_loss"])),
    ]
    if s.get("last_val_loss"):
        step, w, e = s["last_val_loss"]
        rows.append(("validation loss (held out), step " + str(step),
                     _fmt(w) + ("" if e is None else f" (EMA {_fmt(e)})")))
    if s["data_errors"] is not None:
        rows.append(("data errors", _fmt(int(s["data_errors"]))))
    if s["mem_gb_max"] is not None:
        rows.append(("peak memory", f"{s['mem_gb_max']:.3g} GB"))
    rows.append(("events", ", ".join(f"{k}: {n}" for k, n in sorted(s["event_kinds"].items())) or "none"))
    rows.append(("malformed lines skipped", str(s["bad_lines"])))
    return rows


def _events_table(events: list[dict[str, Any]], t0: float | None) -> str:
    shown = events[-MAX_EVENTS_SHOWN:]
    if not shown:
        return "<p>No events (events.jsonl is absent or empty).</p>"
    out = ["<table><tr><th>#</th><th>time (UTC)</th><th>hours</th><th>step</th><th>kind</th><th>details</th></tr>"]
    first = len(events) - len(shown)
    for i, e in enumerate(shown, start=first + 1):
        t = _num(e.get("time"))
        when = datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if t is not None else "–"
        hours = f"{(t - t0) / 3600:.3f}" if t is not None and t0 is not None else "–"
        extra = {k: v for k, v in e.items() if k not in ("time", "step", "kind")}
        details = json.dumps(extra, default=str) if extra else ""
        if len(details) > 300:
            details = details[:300] + "…"
        out.append(f"<tr><td>{i}</td><td>{when}</td><td>{hours}</td><td>{html.escape(_fmt(e.get('step')))}</td>"
                   f"<td class='k-{html.escape(_kind(e))}'>{html.escape(_kind(e))}</td>"
                   f"<td><code>{html.escape(details)}</code></td></tr>")
    out.append("</table>")
    head = f"<p>The last {len(shown)} of {len(events)} events.</p>" if len(events) > len(shown) else ""
    return head + "\n".join(out)


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1500px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
img { max-width: 100%; border: 1px solid #ddd; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: 0.85em; }
.notes { color: #8a5300; }
.k-restart, .k-skip, .k-hang, .k-checkpoint_failed { color: #b00; font-weight: bold; }
figure { display: inline-block; margin: 0 1em 1em 0; vertical-align: top; }
"""


def render_html(data: RunData, summary: dict[str, Any], plots_png: bytes, notes: list[str]) -> str:
    e = html.escape
    name = data.run_dir.resolve().name
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>difftrain report: {e(name)}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>Training report: {e(name)}</h1>",
             f"<p>Run directory <code>{e(str(data.run_dir.resolve()))}</code>, report written {now}.</p>"]
    if data.bad_lines:
        notes.insert(0, f"{data.bad_lines} malformed line(s) skipped (metrics.jsonl: {data.bad_metrics}, "
                        f"events.jsonl: {data.bad_events})")
    if notes:
        parts.append("<ul class='notes'>" + "".join(f"<li>{e(n)}</li>" for n in notes) + "</ul>")
    parts.append("<h2>Summary</h2><table>")
    parts += [f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in _summary_rows(summary)]
    parts.append("</table>")
    parts.append(f"<h2>Plots</h2><img alt='training plots' src='{_data_uri(plots_png)}'>")
    parts.append("<h2>Samples</h2>")
    if data.samples:
        for p in data.samples:
            try:
                uri = _data_uri(_sample_png(p))
            except (OSError, ValueError) as err:
                parts.append(f"<p class='notes'>{e(p.name)}: unreadable ({e(str(err))})</p>")
                continue
            parts.append(f"<figure><img alt='{e(p.name)}' src='{uri}'><figcaption>{e(p.name)}</figcaption></figure>")
    else:
        parts.append("<p>No sample grids (samples/*.png).</p>")
    times = [t for t in (_num(x.get("time")) for x in data.rows + data.events) if t is not None]
    parts.append("<h2>Events</h2>" + _events_table(data.events, min(times) if times else None))
    parts.append("<h2>Config</h2>")
    parts.append(f"<pre>{e(data.config)}</pre>" if data.config is not None else "<p>No config.toml.</p>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """Write ``report.html`` and ``report.png`` for a run directory to ``out`` (default ``RUN/report``).

    Returns the paths and the headline numbers: ``html``, ``png``, ``steps``, ``restarts``,
    ``skipped_steps``, ``checkpoints``, ``rollbacks``, ``events``, ``bad_lines``, ``wall_s``.
    """
    data = read_run(run_dir)
    out = Path(out) if out is not None else data.run_dir / "report"
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: is a file; expected a directory to write report.html and report.png to")
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    summary = summarize(data)
    png = plot_run(data, notes)
    png_path, html_path = out / "report.png", out / "report.html"
    png_path.write_bytes(png)
    html_path.write_text(render_html(data, summary, png, notes), encoding="utf-8")
    return {"html": str(html_path), "png": str(png_path), "steps": summary["steps"],
            "restarts": summary["restarts"], "skipped_steps": summary["skipped_steps"],
            "checkpoints": summary["checkpoints"], "rollbacks": summary["rollbacks"],
            "events": summary["events"], "bad_lines": summary["bad_lines"], "wall_s": summary["wall_s"]}
