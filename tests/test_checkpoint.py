import json

import pytest
import torch

from difftrain.errors import UserError
from difftrain.train.checkpoint import FORMAT, Checkpointer
from difftrain.train.ema import EMA


def _model():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"a": torch.nn.Linear(4, 3), "b": torch.nn.Linear(3, 2)})


def _train(model, opt, steps=3):
    for _ in range(steps):
        model["b"](model["a"](torch.randn(5, 4))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_save_load_round_trip_of_model_optimizer_ema(tmp_path):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ema = EMA(m, 0.9)
    _train(m, opt)
    ema.update()
    ck = Checkpointer(tmp_path)
    path = ck.save(3, m, opt, ema, {"loader": {"step": 3}, "ema_updates": ema.updates})

    m2 = _model()
    with torch.no_grad():
        for p in m2.parameters():
            p.add_(1.0)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=5.0)
    ema2 = EMA(m2, 0.9)
    info = Checkpointer.load(ck.latest(), m2, opt2, ema2)
    assert info["step"] == 3 and info["loader"] == {"step": 3} and ck.latest() == path
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-2)
    for p, q in zip(m.parameters(), m2.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[q][key])
    assert all(torch.equal(ema.shadow[k], ema2.shadow[k]) for k in ema.shadow)
    # training continues identically
    torch.manual_seed(1)
    _train(m, opt, 2)
    torch.manual_seed(1)
    _train(m2, opt2, 2)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_no_pickle_files_and_format_marker(tmp_path):
    m = _model()
    path = Checkpointer(tmp_path).save(1, m, None, None, {})
    names = sorted(p.name for p in path.iterdir())
    assert all(n.endswith((".safetensors", ".json")) for n in names), names
    assert json.loads((path / "trainer.json").read_text())["format"] == FORMAT


def test_keeps_newest_and_ignores_partial(tmp_path):
    m = _model()
    ck = Checkpointer(tmp_path, keep=2)
    for s in (1, 2, 3):
        ck.save(s, m, None, None, {})
    assert [p.name for p in ck.complete_steps()] == ["step_00000002", "step_00000003"]
    # a crash mid-save leaves a .partial directory and maybe a stale pointer: both are ignored
    (tmp_path / "checkpoints" / "step_00000004.partial").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000009")
    assert ck.latest().name == "step_00000003"


def test_foreign_or_broken_checkpoints_are_clear_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such checkpoint"):
        Checkpointer.read_info(tmp_path / "nope")
    (tmp_path / "x").mkdir()
    with pytest.raises(UserError, match="not a difftrain checkpoint"):
        Checkpointer.read_info(tmp_path / "x")
    (tmp_path / "x" / "trainer.json").write_text('{"format": "something-else"}')
    with pytest.raises(UserError, match="not a difftrain checkpoint"):
        Checkpointer.read_info(tmp_path / "x")
    (tmp_path / "x" / "trainer.json").write_text("{broken")
    with pytest.raises(UserError, match="unreadable"):
        Checkpointer.read_info(tmp_path / "x")


def test_loading_into_a_different_model_is_a_user_error(tmp_path):
    path = Checkpointer(tmp_path).save(1, _model(), None, None, {})
    other = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 5), "b": torch.nn.Linear(5, 2)})
    with pytest.raises(UserError, match="does not match"):
        Checkpointer.load(path, other)
