"""``difftrain align`` end to end on a tiny model: candidates, a batch in the rating app (a real server started for
the rating stage), scripted raters answering through its HTTP API (gold items mixed in), the pairs, DPO and the
evaluation before and after; stopped after a stage and resumed without redoing what was done."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from difftrain.config import load_config, to_toml

from conftest import TINY

pytestmark = pytest.mark.slow


def _cli(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "difftrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_round_through_the_app_with_scripted_raters_resumes_at_any_stage(tmp_path):
    base = load_config(None, TINY + ["train.steps=20", "train.checkpoint_every=10", "train.threads=1"])
    (tmp_path / "base.toml").write_text(to_toml(base))
    _cli(["train", "base.toml", "--run-dir", "base", "--no-progress"], tmp_path)
    prompts = ["a small red circle in the top left", "a big blue square", "a small green triangle",
               "a red square in the top right", "a blue circle", "a green circle in the centre"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    cfg = load_config(None, TINY + ["train.threads=1", "train.ema_decay=0", "train.steps=4", "train.checkpoint_every=2",
                                    "train.lr=3e-4", "train.warmup_steps=0", "train.schedule=constant",
                                    "train.global_batch=2", "dpo.init=base", "dpo.beta=200"])
    (tmp_path / "dpo.toml").write_text(to_toml(cfg))
    cmd = ["align", "dpo.toml", "--prompts", "prompts.txt", "--db", "rate.db", "--out", "rounds", "--k", "3",
           "--raters-per-item", "2", "--rater", "auto:ann:light", "--rater", "auto:ben:light",
           "--rater", "auto:cy:noisy", "--rater", "auto:spam:random", "--gold-share", "0.34", "--gold-rate", "0.3",
           "--eval-n", "4"]
    _cli(cmd + ["--until", "rated"], tmp_path)
    record = json.loads((tmp_path / "rounds" / "round_001" / "round.json").read_text())
    assert list(record["stages"]) == ["candidates", "batch", "rated"]
    rated = record["stages"]["rated"]
    assert rated["batch"]["complete"] == rated["batch"]["items"] == record["stages"]["batch"]["items"] > 0
    assert record["stages"]["batch"]["gold_items"] > 0
    assert set(rated["raters"]) == {"ann", "ben", "cy", "spam"}
    assert rated["raters"]["ann"]["gold_agreement"] == 1.0                       # the measure gold is made by
    first = {k: v["at"] for k, v in record["stages"].items()}

    out = json.loads(_cli(cmd, tmp_path).stdout.splitlines()[-1])                 # resumed: pairs, DPO, eval
    record = json.loads((tmp_path / "rounds" / "round_001" / "round.json").read_text())
    assert list(record["stages"]) == ["candidates", "batch", "rated", "pairs", "dpo", "eval"]
    assert {k: record["stages"][k]["at"] for k in first} == first                # nothing done twice
    assert out["rounds"] == 1 and record["stages"]["pairs"]["pairs"] > 0
    assert record["stages"]["dpo"]["steps"] == 4 and record["stages"]["dpo"]["beta"] == 200
    assert (tmp_path / "rounds" / "round_001" / "dpo" / "export" / "model.safetensors").is_file()
    # The eval after is of the DPO run's weights (what its export holds), the one before of the base checkpoint,
    # on the same prompts and noise: the images differ (a round whose DPO changed nothing, or that evaluated the
    # base twice, fails here).
    before, after = record["stages"]["eval"]["before"], record["stages"]["eval"]["after"]
    assert Path(after["checkpoint"]).parent.parent == (tmp_path / "rounds" / "round_001" / "dpo").resolve()
    assert after["step"] == 4 and Path(before["checkpoint"]).name == "step_00000020"
    assert before["prompts_sha256"] == after["prompts_sha256"] and before["seeds"] == after["seeds"]
    assert before["images_sha256"] != after["images_sha256"]
    # A third run has nothing left to do for round 1.
    again = json.loads(_cli(cmd, tmp_path).stdout.splitlines()[-1])
    assert again["last"]["stages"]["eval"]["at"] == record["stages"]["eval"]["at"]

    bad = _cli(["align", "dpo.toml", "--prompts", "prompts.txt", "--db", "rate.db", "--out", "r2", "--rater",
                "auto:solo", "--raters-per-item", "2"], tmp_path, check=False)
    assert bad.returncode == 2 and "1 automatic rater(s) for --raters-per-item 2" in bad.stderr

    # Fewer answers: pairwise items, one pair a prompt chosen by the model for 4 of the 6 prompts, each served
    # until its answers settle it (at least 2 raters, at most 3); every answer one judgement.
    pairwise = ["align", "dpo.toml", "--prompts", "prompts.txt", "--db", "rate2.db", "--out", "chosen", "--k", "3",
                "--kind", "pairwise", "--select-items", "4", "--stop-confidence", "0.9", "--raters-per-item", "3",
                "--rater", "auto:ann:light", "--rater", "auto:ben:light", "--rater", "auto:spam:random",
                "--eval-n", "4", "--until", "rated"]
    _cli(pairwise, tmp_path)
    record = json.loads((tmp_path / "chosen" / "round_001" / "round.json").read_text())
    batch, rated = record["stages"]["batch"], record["stages"]["rated"]
    assert batch["selected"]["items"] == 4 and batch["selected"]["rule"] == "spread" and batch["items"] == 4
    assert batch["stop_confidence"] == 0.9
    lines = (tmp_path / "chosen" / "round_001" / "selected" / "candidates.jsonl").read_text().splitlines()
    assert len(lines) == 8 and len({json.loads(x)["prompt_id"] for x in lines}) == 4
    cost = rated["cost"]
    assert 8 <= cost["judgements"] <= 12 and cost["judgements"] <= cost["answers"]
    assert rated["batch"]["complete"] == 4
    # A second round asks the same way about the candidates of the model the first trained, against that model as
    # its reference: its pairs are chosen anew, its answers spent anew.
    two = [x for x in pairwise if x not in ("--until", "rated")] + ["--rounds", "2", "--eval-n", "0"]
    out = json.loads(_cli(two, tmp_path).stdout.splitlines()[-1])
    assert out["rounds"] == 2
    second = json.loads((tmp_path / "chosen" / "round_002" / "round.json").read_text())
    first_dpo = (tmp_path / "chosen" / "round_001" / "dpo").resolve()
    assert Path(second["start"]) == first_dpo
    assert Path(json.loads((tmp_path / "chosen" / "round_002" / "candidates" / "manifest.json").read_text())
                ["checkpoint"]).resolve().is_relative_to(first_dpo)
    assert second["stages"]["batch"]["selected"]["items"] == 4 and second["stages"]["dpo"]["steps"] == 4
    assert 8 <= second["stages"]["rated"]["cost"]["judgements"] <= 12
    assert second["stages"]["batch"]["batch"] != record["stages"]["batch"]["batch"]
    bad = _cli(["align", "dpo.toml", "--prompts", "prompts.txt", "--db", "rate3.db", "--out", "r3",
                "--select-items", "2"], tmp_path, check=False)
    assert bad.returncode == 2 and "add --kind pairwise" in bad.stderr


def test_gold_prompts_are_drawn_apart_from_the_validation_split(tmp_path):
    """Gold prompts (left out of the pairs) and the validation split are independent draws: the same hash would
    make the gold share swallow every validation prompt (a round with no validation pairs)."""
    import numpy as np
    from PIL import Image

    from difftrain.align.loop import _gold_file
    from difftrain.align.pairs import _split

    (tmp_path / "images").mkdir()
    Image.fromarray(np.full((8, 8, 3), 100, np.uint8)).save(tmp_path / "images" / "x.png")
    ids = [f"p{n:06d}" for n in range(1000)]
    rows = [{"id": f"{p}-0", "prompt_id": p, "image": "images/x.png"} for p in ids]
    (tmp_path / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gold = {json.loads(x)["prompt_id"] for x in _gold_file(tmp_path, "light", 0.15, 1, tmp_path / "g.jsonl")
            .read_text().splitlines()}
    validation = {p for p in ids if _split(1, p, 0.1) == "validation"}
    assert 100 < len(gold) < 200 and 60 < len(validation) < 140
    rest = validation - gold
    assert 0.8 * len(validation) * 0.85 < len(rest) < 1.2 * len(validation) * 0.85      # independent: ~85% left


def test_gold_pairs_the_measure_cannot_tell_apart_are_left_out(tmp_path):
    """A pair whose shades differ by less than the measure's just-noticeable difference is no gold question: an
    honest rater calls it a tie and would be flagged for it. Rankings keep their gold."""
    import numpy as np
    from PIL import Image

    from difftrain.align.loop import _gold_file

    (tmp_path / "images").mkdir()
    rows = []
    for p in range(40):
        shades = (120, 121) if p % 2 else (110, 150)              # odd prompts: one grey level apart
        for j, shade in enumerate(shades):
            Image.fromarray(np.full((16, 16, 3), shade, np.uint8)).save(tmp_path / "images" / f"{p}-{j}.png")
            rows.append({"id": f"p{p:03d}-{j}", "prompt_id": f"p{p:03d}", "image": f"images/{p}-{j}.png"})
    (tmp_path / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gold = [json.loads(x) for x in _gold_file(tmp_path, "light", 0.99, 0, tmp_path / "g.jsonl").read_text()
            .splitlines()]
    assert len(gold) >= 15 and all(int(g["prompt_id"][1:]) % 2 == 0 for g in gold)
    assert all(g["order"] == [f"{g['prompt_id']}-1", f"{g['prompt_id']}-0"] for g in gold)   # the lighter first


def test_gold_read_with_the_caption_orders_an_unfaithful_image_last_and_asks_no_both_bad_pair(tmp_path):
    """Gold made by a ``+caption`` measure agrees with the rater who reads the caption: the image that does not
    show its caption last whatever its shade; a pair where neither does is no gold question."""
    import dataclasses

    import numpy as np
    from PIL import Image

    from difftrain.align.loop import _gold_file
    from difftrain.shapes.world import render, sample_shape

    (tmp_path / "images").mkdir()
    rows = []
    for p in range(30):
        spec = sample_shape(np.random.default_rng(p), (100, 160))
        other = next(c for c in ("red", "green", "blue", "yellow") if c != spec.color)
        wrong = dataclasses.replace(spec, color=other, bg=150)     # lighter, but not what was asked
        right = dataclasses.replace(spec, bg=110)
        pair = (wrong, right) if p % 2 == 0 else (wrong, dataclasses.replace(wrong, bg=110))
        for j, s in enumerate(pair):
            Image.fromarray(render(s, 48)).save(tmp_path / "images" / f"{p}-{j}.png")
            rows.append({"id": f"p{p:03d}-{j}", "prompt_id": f"p{p:03d}", "prompt": spec.caption(), "task": "t2i",
                         "image": f"images/{p}-{j}.png"})
    (tmp_path / "candidates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_pixels = [json.loads(x) for x in _gold_file(tmp_path, "light", 0.99, 0, tmp_path / "a.jsonl").read_text()
                 .splitlines()]
    by_caption = [json.loads(x) for x in _gold_file(tmp_path, "light+caption", 0.99, 0, tmp_path / "b.jsonl")
                  .read_text().splitlines()]
    assert len(by_pixels) >= 25 and any(int(g["prompt_id"][1:]) % 2 for g in by_pixels)
    assert all(g["order"][0].endswith("-0") for g in by_pixels)                      # the lighter, wrong or not
    assert len(by_caption) >= 12 and all(int(g["prompt_id"][1:]) % 2 == 0 for g in by_caption)
    assert all(g["order"] == [f"{g['prompt_id']}-1", f"{g['prompt_id']}-0"] for g in by_caption)
