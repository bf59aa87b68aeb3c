"""``difftrain prepare`` at scale: curation as Ray Data operations reproduces the recorded curation of the
shapes export exactly. Real Ray (the session's local one, conftest) and real Lance."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from difftrain.config import load_config, preset_path
from difftrain.data.curate import read_record
from difftrain.data.prepare import prepare
from difftrain.shapes.export import export_shapes

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent / "fixtures" / "shapes_curation.parquet"
# Curation does not depend on the stages; one stage fed by the keyframe clips alone keeps the encoding short.
ONE_STAGE = '[{name = "low", start_step = 0, buckets = [[48, 48]], global_batch = 8, mixture = {shapes_keyframes = 1}}]'


@pytest.fixture(scope="module")
def shapes_default(tmp_path_factory):
    """``difftrain shapes export shapes-export`` with its defaults, in a folder of its own (the preset's paths
    are relative to the working directory)."""
    root = tmp_path_factory.mktemp("default-export")
    export_shapes(root / "shapes-export")
    return root


def fixture_rows(export: Path) -> list[tuple[str, str, str]]:
    t = pq.read_table(FIXTURE).to_pylist()
    return [(r["source"], r["key"], r["reason"].replace("{export}", str(export))) for r in t]


def record_rows(path: str) -> list[tuple[str, str, str]]:
    t = read_record(path).to_pylist()
    return sorted((r["source"], r["key"], r["reason"]) for r in t)


def test_curation_of_the_shapes_export_reproduces_the_fixture(ray_local, shapes_default, monkeypatch):
    """The kept set and every reason, row for row, as the curation of the shapes export recorded before
    curation ran on Ray Data (tests/fixtures/shapes_curation.parquet)."""
    monkeypatch.chdir(shapes_default)
    cfg = load_config(preset_path("shapes-store"), [f"data.stages={ONE_STAGE}"])
    summary = prepare(cfg, progress=False)
    want = fixture_rows(shapes_default / "shapes-export")
    got = record_rows("shapes-store/curation.parquet")
    assert len(got) == len(want) == summary["inputs"] == 1212
    assert got == sorted(want)
    assert summary["kept"] == sum(r == "" for _, _, r in want) == 996
