"""``difftrain.report.write_report``: an HTML + PNG report of a run directory, built from a synthetic run
with a restart (replayed steps), a truncated last metrics line, events, sample grids and a config."""

import json

import pytest
from PIL import Image

from difftrain.errors import UserError
from difftrain.report import last_row_per_step, read_run, write_report

T0 = 1_700_000_000.0
REPLAYED_LOSS = 0.123456


def _row(step: int, t: float, restarts: int, skipped: int, loss: float) -> dict:
    return {"step": step, "time": t, "loss": loss, "loss_t2i": loss * 0.9, "loss_edit": loss * 1.1,
            "grad_norm": 0.5, "lr": 1e-4, "samples_per_s": 100.0 + step, "tokens_per_s": 5000.0, "mfu": 0.4,
            "data_s": 0.01, "fwd_bwd_s": 0.2, "optim_s": 0.05, "step_s": 0.26,
            "checkpoint_stall_s": 2.5 if step % 10 == 0 else 0.0, "skipped_steps": skipped,
            "restarts": restarts, "mem_gb": 40.0, "task": "t2i" if step % 2 else "edit"}


@pytest.fixture
def run_dir(tmp_path):
    """Steps 1-20, a preemption, a resume from the step-10 checkpoint, steps 11-25, a cut-off line."""
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    lines = []
    for s in range(1, 21):
        lines.append(_row(s, T0 + 10 * s, 0, (s >= 7) + (s >= 15), 1.0 / s))
    t_resume = T0 + 600
    for s in range(11, 26):
        loss = REPLAYED_LOSS if s == 15 else 1.0 / s
        lines.append(_row(s, t_resume + 10 * (s - 10), 1, 2 + (s >= 22), loss))
    text = "\n".join(json.dumps(r) for r in lines) + '\n{"step": 26, "loss": 0.0'   # killed mid-write
    (run / "metrics.jsonl").write_text(text)

    events = [
        {"time": T0, "step": 0, "kind": "start"},
        {"time": T0 + 70, "step": 7, "kind": "skip", "sample_ids": [3, 9], "reason": "nan loss"},
        {"time": T0 + 100, "step": 10, "kind": "checkpoint", "stall_s": 2.0, "path": "ckpt/10"},
        {"time": T0 + 120, "step": 12, "kind": "spike", "loss": 3.0},
        {"time": T0 + 130, "step": 13, "kind": "straggler", "rank": 3, "seconds": 1.5},
        {"time": T0 + 150, "step": 15, "kind": "skip"},
        {"time": T0 + 160, "step": 16, "kind": "rollback", "to_step": 10},
        {"time": T0 + 190, "step": 19, "kind": "checkpoint_failed", "reason": "disk full"},
        {"time": T0 + 200, "step": 20, "kind": "checkpoint", "stall_s": 4.0},
        {"time": T0 + 205, "step": 20, "kind": "preempt"},
        {"time": t_resume, "step": 10, "kind": "restart", "reason": "preempted"},
        {"time": t_resume + 1, "step": 10, "kind": "resume", "path": "ckpt/10"},
        {"time": t_resume + 100, "step": 20, "kind": "checkpoint", "stall_s": 3.0},
        {"time": t_resume + 120, "step": 22, "kind": "skip"},
        {"time": t_resume + 130, "kind": "custom_probe"},                      # no step, unknown kind
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for i in range(1, 5):   # four grids: only the newest three by name go into the page
        Image.new("RGB", (64, 32), (60 * i, 20, 200)).save(run / "samples" / f"step_{i:04d}.png")
    (run / "config.toml").write_text('[run]\nname = "a<b & c"\n[train]\nlr = 1e-4\n')
    return run


def test_report_files_numbers_and_embedding(run_dir):
    res = write_report(run_dir)
    html_path, png_path = run_dir / "report" / "report.html", run_dir / "report" / "report.png"
    assert res["html"] == str(html_path) and res["png"] == str(png_path)
    assert html_path.is_file() and png_path.is_file()
    with Image.open(png_path) as im:
        im.verify()
    with Image.open(png_path) as im:
        assert im.format == "PNG" and im.width >= 800 and im.height >= 500

    assert res["steps"] == 25
    assert res["restarts"] == 1
    assert res["skipped_steps"] == 3
    assert res["checkpoints"] == 3          # checkpoint_failed is not a checkpoint
    assert res["rollbacks"] == 1
    assert res["events"] == 15
    assert res["bad_lines"] == 1
    assert res["wall_s"] == pytest.approx(600 + 150)

    page = html_path.read_text()
    # The figure plus the newest three of four sample grids, all inline.
    assert page.count("data:image/png;base64,") == 4
    assert "step_0004.png" in page and "step_0002.png" in page and "step_0001.png" not in page
    for name, value in [("restarts", "1"), ("skipped steps", "3"), ("checkpoints", "3"), ("rollbacks", "1"),
                        ("steps reached", "25"), ("malformed lines skipped", "1")]:
        assert f"<th>{name}</th><td>{value}</td>" in page, name
    assert "3 s / 4 s" in page                      # checkpoint stall mean / max from the events
    assert "1 malformed line(s) skipped" in page
    assert "a&lt;b &amp; c" in page and "a<b" not in page
    assert "custom_probe" in page and "disk full" in page
    assert "src='http" not in page and 'src="http' not in page      # self-contained


def test_replayed_steps_use_last_row_written(run_dir):
    data = read_run(run_dir)
    assert data.bad_metrics == 1 and data.bad_events == 0
    by_step = last_row_per_step(data.rows)
    assert [r["step"] for r in by_step] == list(range(1, 26))
    assert {r["step"]: r for r in by_step}[15]["loss"] == REPLAYED_LOSS
    assert {r["step"]: r for r in by_step}[15]["restarts"] == 1


def test_sparse_run_has_no_data_panels(tmp_path):
    """Only step and loss, no times, no events file beyond one broken line, no samples, no config."""
    run = tmp_path / "sparse"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6))
                                       + "\n" + json.dumps({"loss": 1.0}) + "\n")   # a row without a step
    (run / "events.jsonl").write_text('{"time": 1, "kind": "sta\n')
    out = tmp_path / "elsewhere"
    res = write_report(run, out)
    assert res["html"] == str(out / "report.html") and (out / "report.png").is_file()
    assert res["steps"] == 5 and res["restarts"] == 0 and res["checkpoints"] == 0 and res["events"] == 0
    assert res["bad_lines"] == 2
    page = (out / "report.html").read_text()
    assert "no data" in page and page.count("data:image/png;base64,") == 1
    assert "No config.toml" in page and "No sample grids" in page


def test_not_a_run_dir(tmp_path):
    with pytest.raises(UserError, match="metrics.jsonl") as err:
        write_report(tmp_path / "missing")
    assert str(tmp_path / "missing") in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="metrics.jsonl") as err:
        write_report(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(err.value)
