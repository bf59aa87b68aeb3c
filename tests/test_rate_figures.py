"""The rating app's figures and exports: Krippendorff's alpha against the ``krippendorff`` package, win rates and
Bradley–Terry on comparison batches, spammers flagged by gold and left out of the export, the export turned into
the pairs file of ``difftrain pairs`` by ``difftrain rate export``; and the app installs and runs without torch."""

from __future__ import annotations

import ast
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from difftrain_rate import assign
from difftrain_rate.batches import import_batch
from difftrain_rate.db import Database, Item, upgrade
from difftrain_rate.report import admin_figures
from difftrain_rate.stats import bradley_terry, krippendorff_alpha, wilson

from rate_helpers import add_users, candidates_folder

RATE = Path(__file__).resolve().parents[1] / "rate"


def test_alpha_matches_the_krippendorff_package():
    krippendorff = pytest.importorskip("krippendorff")
    rng = np.random.default_rng(0)
    for trial in range(20):
        raters, units = int(rng.integers(2, 6)), int(rng.integers(5, 40))
        truth = rng.integers(-1, 2, size=units)
        data = np.where(rng.random((raters, units)) < 0.7, truth, rng.integers(-1, 2, size=(raters, units))).astype(float)
        data[rng.random((raters, units)) < 0.2] = np.nan                  # missing answers
        ours = krippendorff_alpha({u: [None if np.isnan(v) else int(v) for v in data[:, u]] for u in range(units)})
        ref = krippendorff.alpha(reliability_data=data, level_of_measurement="nominal")
        assert ours == pytest.approx(ref, abs=1e-9), trial
        ours_i = krippendorff_alpha({u: [None if np.isnan(v) else float(v) for v in data[:, u]]
                                     for u in range(units)}, "interval")
        assert ours_i == pytest.approx(krippendorff.alpha(reliability_data=data, level_of_measurement="interval"),
                                       abs=1e-9)
    assert krippendorff_alpha({0: [1, 1], 1: [1, 1]}) is None               # no variation: undefined


def test_bradley_terry_and_wilson():
    games = [("a", "b", 1.0)] * 30 + [("a", "b", 0.0)] * 10 + [("b", "c", 1.0)] * 25 + [("b", "c", 0.0)] * 15
    s = bradley_terry(games)
    assert s["a"] > s["b"] > s["c"] and abs(sum(s.values())) < 1e-9
    assert s["a"] - s["b"] == pytest.approx(np.log(30.5 / 10.5), abs=0.15)  # 3:1 with the prior's half games
    lo, hi = wilson(60, 100)
    assert lo == pytest.approx(0.5020, abs=1e-3) and hi == pytest.approx(0.6906, abs=1e-3)


def _answer_all(db: Database, rater_id: int, choose, seed: int) -> int:
    rng, n = random.Random(seed), 0
    while (it := assign.next_item(db, rater_id, rng)) is not None:
        handles = [v[0] for v in it.order]
        with db.read() as s:
            item = s.get(Item, it.item.id)
            cand = {img.id: img for img in item_images(s, item)}
        order, outcome = choose(handles, cand, item, rng)
        assign.answer(db, rater_id, it.assignment, f"{rater_id}-{n}", order, outcome, {})
        n += 1
    return n


def item_images(s, item):
    from difftrain_rate.db import Image
    return [s.get(Image, v[0]) for v in item.images]


def test_comparison_win_rate_spammer_flagged_and_export_to_pairs(tmp_path):
    url = str(tmp_path / "r.db")
    upgrade(url)
    db = Database(url)
    add_users(db, "good1", "good2", "noisy", "spam")
    # Candidates: a lighter image is better (shade grows with k).
    folder = candidates_folder(tmp_path / "c", prompts=20, k=3)
    gold = tmp_path / "gold.jsonl"
    gold.write_text("".join(json.dumps({"prompt_id": f"p{p:03d}", "order": [f"p{p:03d}-2", f"p{p:03d}-1",
                                                                           f"p{p:03d}-0"]}) + "\n" for p in range(8)))
    import_batch(db, "round", [str(folder)], kind="ranking", raters=3, gold=str(gold), gold_rate=0.4, seed=1)

    def by_shade(handles, cand, item, rng):
        k = {h: int(cand[h].candidate.rsplit("-", 1)[1]) for h in handles}
        return sorted(handles, key=lambda h: -k[h]), "ranked"

    def noisy(handles, cand, item, rng):
        return (rng.sample(handles, len(handles)), "ranked") if rng.random() < 0.2 else by_shade(handles, cand, item, rng)

    def spam(handles, cand, item, rng):
        return rng.sample(handles, len(handles)), "ranked"

    for uid, choose in ((1, by_shade), (2, by_shade), (3, noisy), (4, spam)):
        _answer_all(db, uid, choose, uid)
    f = admin_figures(db)
    raters = f["raters"]
    assert raters["spam"]["flagged"] and not raters["noisy"]["flagged"] and not raters["good1"]["flagged"]
    assert raters["good1"]["gold_agreement"] == 1.0 and raters["spam"]["gold_agreement"] < 0.7
    batch = f["batches"][0]
    assert batch["complete"] == 12 and batch["items"] == 12 and batch["alpha"]["overall"] > 0.6

    # The export: flagged raters left out, gold left out; through 'difftrain rate export' into the pairs file.
    out = subprocess.run([sys.executable, "-m", "difftrain", "rate", "export", "--db", url, "--out",
                          str(tmp_path / "pairs.parquet"), "--validation", "0"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["rankings"] == 12 * 3 - sum(1 for _ in ()) - raters["spam"]["answers"] + _gold_answers(db, "spam")
    import pyarrow.parquet as pq
    rows = pq.read_table(tmp_path / "pairs.parquet").to_pylist()
    assert len(rows) == 12 * 3 and all(int(r["winner"][-1]) > int(r["loser"][-1]) for r in rows)
    assert {r["prompt_id"] for r in rows}.isdisjoint({f"p{p:03d}" for p in range(8)})    # gold prompts not exported
    bad = subprocess.run([sys.executable, "-m", "difftrain", "rate", "export", "--db", url, "--out", "x.parquet",
                          "--batch", "nope"], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "--batch 'nope': no such one-folder batch" in bad.stderr


def _gold_answers(db, name: str) -> int:
    from sqlalchemy import func, select

    from difftrain_rate.db import Answer, User
    with db.read() as s:
        return s.scalar(select(func.count()).select_from(Answer).join(Item, Item.id == Answer.item_id)
                        .join(User, User.id == Answer.rater_id).where(User.name == name, Item.gold.is_not(None)))


def test_comparison_batch_gives_a_win_rate_and_a_bradley_terry_ranking(tmp_path):
    url = str(tmp_path / "r.db")
    upgrade(url)
    db = Database(url)
    add_users(db, "a", "b")
    early = candidates_folder(tmp_path / "early", prompts=10, k=2, step=100, shade=lambda p, k: 40)
    late = candidates_folder(tmp_path / "late", prompts=10, k=2, step=200, shade=lambda p, k: 200)
    import_batch(db, "late-vs-early", [str(late), str(early)], raters=2, seed=0)

    def lighter(handles, cand, item, rng):       # the late checkpoint (model 0 here) is preferred 3 times in 4
        best = [h for h in handles if cand[h].model == 0] if rng.random() < 0.75 else \
            [h for h in handles if cand[h].model == 1]
        return best + [h for h in handles if h not in best], "ranked"

    for uid in (1, 2):
        _answer_all(db, uid, lighter, uid)
    c = admin_figures(db)["batches"][0]["comparison"]
    assert c["n"] == 40 and c["ci95"][0] < c["a_win_rate"] < c["ci95"][1] and c["a_win_rate"] > 0.5
    bt = admin_figures(db)["bradley_terry"]
    assert bt[0]["model"].endswith("late@200") and bt[1]["model"].endswith("early@100")


def test_the_app_imports_no_torch_and_its_package_does_not_depend_on_it(tmp_path):
    deps = (RATE / "pyproject.toml").read_text()
    assert "torch" not in deps.split("[project.optional-dependencies]")[0].split("dependencies")[1]
    for f in (RATE / "src" / "difftrain_rate").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] in ("torch", "difftrain", "numpy") for n in names), (f, names)
    # A process in which torch cannot be imported serves a page.
    code = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'difftrain'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
from difftrain_rate.cli import run
run(['upgrade', '--db', {str(tmp_path / 'x.db')!r}])
from fastapi.testclient import TestClient
from difftrain_rate.app import create_app
r = TestClient(create_app({str(tmp_path / 'x.db')!r})).get('/login')
assert r.status_code == 200 and 'Sign in' in r.text
print('ok', 'torch' in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(RATE / "src")})
    assert out.returncode == 0 and out.stdout.split()[-2:] == ["ok", "False"], out.stderr[-2000:]
