"""Bad input at the command line: one clear line, a non-zero exit, no traceback (``--debug`` shows it)."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from difftrain.cli import main


def run_cli(*args, cwd=None):
    env = dict(os.environ, PYTHONWARNINGS="default")
    return subprocess.run([sys.executable, "-m", "difftrain", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run directory with a checkpoint from a few steps of a tiny config."""
    from difftrain.config import load_config, to_toml
    from conftest import TINY
    root = tmp_path_factory.mktemp("cli")
    cfg = root / "tiny.toml"
    cfg.write_text(to_toml(load_config(None, TINY + ["train.steps=3", "train.checkpoint_every=0"])))
    assert main(["train", str(cfg), "--run-dir", str(root / "run"), "--no-progress"]) == 0
    return root


def test_help_explains_every_verb_and_option():
    r = run_cli("--help")
    assert r.returncode == 0
    for verb in ("demo", "train", "sample", "eval", "config"):
        assert verb in r.stdout
    r = run_cli("sample", "--help")
    for opt in ("--prompt", "--edit", "--frames", "--seed", "--steps", "--cfg-scale", "--out"):
        assert opt in r.stdout


def _one_line_error(r, *words):
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr, r.stderr
    assert lines and lines[-1].startswith("error:"), r.stderr
    for w in words:
        assert w in lines[-1], (w, lines[-1])


def test_missing_and_invalid_config(tmp_path):
    _one_line_error(run_cli("train", str(tmp_path / "nope.toml")), "nope.toml", "not found")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlr = 'fast'\n")
    _one_line_error(run_cli("train", str(bad)), "train.lr", "'fast'", "number")
    _one_line_error(run_cli("config", "show", "shapes-tiny", "--set", "data.image_size=50"), "data.image_size", "multiple")


def test_debug_shows_the_traceback(tmp_path):
    r = run_cli("--debug", "train", str(tmp_path / "nope.toml"))
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_checkpoint_that_is_not_ours(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x00" * 16)
    _one_line_error(run_cli("sample", str(tmp_path / "ckpt"), "--prompt", "x"), "not a difftrain checkpoint")
    _one_line_error(run_cli("eval", str(tmp_path / "missing")), "no such checkpoint")


def test_unreadable_image_frames_zero_and_long_prompt(trained, tmp_path):
    ckpt = str(trained / "run" / "checkpoints" / "latest")
    junk = tmp_path / "junk.png"
    junk.write_text("this is not a png")
    _one_line_error(run_cli("sample", ckpt, "--prompt", "make it blue", "--edit", str(junk)), "junk.png",
                    "cannot read")
    _one_line_error(run_cli("sample", ckpt, "--prompt", "make it blue", "--edit", str(tmp_path / "none.png")),
                    "none.png", "not found")
    _one_line_error(run_cli("sample", ckpt, "--prompt", "a red circle", "--frames", "0"), "--frames 0")
    long = " ".join(["a small red circle in the top left"] * 5)
    r = run_cli("sample", ckpt, "--prompt", long, "--num-images", "1", "--steps", "2", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    warning = [ln for ln in r.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warning) == 1 and "truncated" in warning[0] and "16" in warning[0]
    assert len(json.loads(r.stdout)["images"]) == 1


def test_guidance_on_a_model_trained_without_caption_dropout_is_warned(tiny_cfg, caplog):
    from difftrain.inference import guidance_scale
    no_dropout = tiny_cfg("data.caption_dropout=0.0", "sample.cfg_scale=1.0")
    with caplog.at_level("WARNING", logger="difftrain"):
        assert guidance_scale(no_dropout, None) == 1.0 and guidance_scale(no_dropout, 1) == 1.0
        assert not caplog.records
        assert guidance_scale(no_dropout, 3.0) == 3.0
        assert len(caplog.records) == 1 and "caption_dropout = 0" in caplog.records[0].getMessage()
        caplog.clear()
        assert guidance_scale(tiny_cfg("data.caption_dropout=0.1", "sample.cfg_scale=4.0"), None) == 4.0
        assert not caplog.records


def _busy(seconds: float, started) -> None:
    started.set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


_SMALL_DEMO = ["model.hidden=32", "model.heads=2", "model.double_blocks=1", "model.single_blocks=1",
               "model.axes_dims_rope=[4, 6, 6]", "text.dim=16", "data.image_size=32"]


def test_the_demo_recipe_is_a_fixed_step_count():
    from difftrain.config import load_config, preset_path

    cfg = load_config(preset_path("shapes-tiny"), [])
    assert cfg.train.minutes == 0 and 1000 <= cfg.train.steps <= 20_000


def test_pace_estimates_from_the_first_steps_then_gives_an_eta():
    from difftrain.progress import Pace

    now = [100.0]
    pace = Pace(first=4, clock=lambda: now[0])
    lines = []
    for step in range(1, 11):
        now[0] += 5.0 if step == 1 else 0.5     # the first step (start-up) is slow and is not counted
        lines.append(pace.update(step, 100))
    assert [i for i, x in enumerate(lines) if x] == [4]       # once, after 4 timed steps (steps 2-5)
    assert pace.estimate == {"steps": 100, "s_per_step": 0.5, "measured_steps": 4, "seconds_left": 47.5}
    assert "100 steps at 0.500 s a step" in lines[4] and "0m50s of training" in lines[4]
    assert pace.eta(100) == " eta 0m45s"                     # 90 steps left at 0.5 s


def test_a_time_budget_demo_says_so(tmp_path):
    from difftrain.config import preset_path
    from difftrain.demo import run_demo

    sets = ["train.threads=1", "train.log_every=1", "eval.n=2", "sample.steps=2"] + _SMALL_DEMO
    out = run_demo(preset_path("shapes-tiny"), tmp_path / "timed", 0.05, sets, progress=False)
    assert out["budget"] == "time: 0.05 min (steps follow the machine's speed)"
    assert out["steps"] >= 1 and out["s_per_step"] > 0


def test_a_fixed_step_demo_trains_the_same_model_however_loaded_the_machine(tmp_path):
    """The demo at a fixed step count (no time budget): the same summary on a quiet machine and beside a program
    keeping a core busy: losses, accuracies and the digest of the final EMA weights; the summary says what makes
    runs comparable (budget, steps, threads, torch build, a CPU speed probe)."""
    import multiprocessing

    from difftrain.config import preset_path
    from difftrain.demo import run_demo

    # no train.minutes here: the recipe's default is a fixed step count
    sets = ["train.steps=6", "train.threads=1", "train.log_every=1", "eval.n=2", "sample.steps=2"] + _SMALL_DEMO
    quiet = run_demo(preset_path("shapes-tiny"), tmp_path / "quiet", None, sets, progress=False)
    ctx = multiprocessing.get_context("spawn")
    started = ctx.Event()
    load = ctx.Process(target=_busy, args=(120, started))
    load.start()
    assert started.wait(60)                    # the competing load runs before the second demo starts
    try:
        loaded = run_demo(preset_path("shapes-tiny"), tmp_path / "loaded", None, sets, progress=False)
    finally:
        load.terminate()
        load.join()
    assert quiet["budget"] == "steps: 6" and quiet["steps"] == loaded["steps"] == 6
    assert quiet["estimate_s_per_step"] > 0              # the estimate from the first steps, kept in the summary
    assert quiet["threads"] == 1 and quiet["torch"] == torch.__version__ and quiet["probe_gflops"] > 0
    assert quiet["cpu_capability"] == str(torch.backends.cpu.get_cpu_capability()) == loaded["cpu_capability"]
    same = ("weights_sha256", "t2i_color_acc", "t2i_position_acc", "t2i_shape_acc", "edit_acc", "keyframe_acc")
    assert {k: quiet[k] for k in same} == {k: loaded[k] for k in same}
    losses = [[json.loads(x)["loss"] for x in (tmp_path / d / "run" / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(x)] for d in ("quiet", "loaded")]
    assert len(losses[0]) == 6 and losses[0] == losses[1]
