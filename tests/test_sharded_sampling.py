"""Sampling a model that does not fit one device: under torchrun (2 gloo ranks) ``sample`` and ``eval`` shard the
model as training does (FSDP2), each rank generating its slice of the images or its batches, and the images are
those of one process for the same seeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from difftrain.config import load_config, to_toml

from conftest import TINY

pytestmark = pytest.mark.slow


def _cli(args: list[str], cwd: Path, ranks: int = 1) -> str:
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
              if ranks > 1 else [sys.executable])
    proc = subprocess.run(launch + ["-m", "difftrain", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sharded")
    # eval.n = 40: two batches of 32 a task, so the batches go round-robin over the two ranks
    (d / "tiny.toml").write_text(to_toml(load_config(None, TINY + [
        "train.steps=30", "train.checkpoint_every=30", "train.threads=1", "eval.n=40", "train.lr=3e-3"])))
    _cli(["train", "tiny.toml", "--run-dir", "run", "--no-progress"], d)
    return d


def _pixels(paths: list[str]) -> list[np.ndarray]:
    return [np.asarray(Image.open(p)) for p in paths]


def _under(root: Path, paths: list[str]) -> list[str]:
    return [str(root / p) for p in paths]


def test_sample_on_two_ranks_draws_the_images_one_process_draws(run):
    args = ["sample", "run", "--prompt", "a small red circle in the top left", "--num-images", "5", "--seed", "7"]
    one = json.loads(_cli(args + ["--out", "one"], run).splitlines()[-1])
    two = json.loads(_cli(args + ["--out", "two"], run, ranks=2).splitlines()[-1])
    assert len(one["images"]) == len(two["images"]) == 5
    a, b = _pixels(_under(run, one["images"])), _pixels(_under(run, two["images"]))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(a[0], x) for x in a[1:])           # five different images, not one repeated


def test_eval_on_two_ranks_scores_the_images_one_process_scores(run):
    one = _cli(["eval", "run", "--json", "--grid", "one.png"], run).splitlines()[-1]
    two = _cli(["eval", "run", "--json", "--grid", "two.png"], run, ranks=2).splitlines()[-1]
    assert json.loads(one) == json.loads(two)
    assert np.array_equal(*_pixels([str(run / "one.png"), str(run / "two.png")]))
