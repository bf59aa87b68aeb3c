import json
import tomllib

import pytest

from difftrain.cli import main
from difftrain.config import PRESETS as REPO_CONFIGS
from difftrain.config import Config, from_dict, load_config, to_toml
from difftrain.config.load import parse_override
from difftrain.errors import UserError
from difftrain.models import build_dit, config_dit_params, num_params


def test_defaults_validate_and_round_trip_through_toml():
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    assert from_dict(tomllib.loads(to_toml(cfg))) == cfg


@pytest.mark.parametrize("preset", ["shapes-tiny", "flux-dev", "dit-24b"])
def test_presets_load_and_round_trip(preset):
    cfg = load_config(REPO_CONFIGS / f"{preset}.toml")
    assert from_dict(tomllib.loads(to_toml(cfg))) == cfg


def test_the_dpo_preset_keeps_the_demo_model():
    """shapes-dpo starts from the demo's checkpoint (dpo.init): its model, text encoder, autoencoder and flow must be
    the demo's, or the checkpoint does not load (or, for the flow, DPO weighs errors as the base never trained)."""
    demo, dpo = load_config(REPO_CONFIGS / "shapes-tiny.toml"), load_config(REPO_CONFIGS / "shapes-dpo.toml")
    for section in ("model", "text", "autoencoder", "diffusion"):
        assert getattr(dpo, section) == getattr(demo, section), section


def test_overrides_are_typed_and_applied():
    cfg = load_config(REPO_CONFIGS / "shapes-tiny.toml",
                      ["train.lr=2e-4", "train.compile=true", "model.axes_dims_rope=[8, 8, 16]", "run.name=abc"])
    assert cfg.train.lr == 2e-4 and cfg.train.compile is True
    assert cfg.model.axes_dims_rope == [8, 8, 16] and cfg.run.name == "abc"
    assert parse_override("run.name=hello world") == (["run", "name"], "hello world")


@pytest.mark.parametrize("override, words", [
    ("train.lr=abc", ["train.lr", "'abc'", "number"]),
    ("train.steps=1.5", ["train.steps", "integer"]),
    ("train.steps=-1", ["train.steps", "-1", ">= 0"]),
    ("train.beta2=1.0", ["train.beta2", "< 1"]),
    ("train.optimizer=sgd", ["train.optimizer", "'sgd'", "'muon'"]),
    ("train.muon_ns_steps=0", ["train.muon_ns_steps", ">= 1"]),
    ("train.muon_momentum=1", ["train.muon_momentum", "< 1"]),
    ("diffusion.timesteps=gauss", ["diffusion.timesteps", "'gauss'", "'uniform'"]),
    ("diffusion.loss=eps", ["diffusion.loss", "'eps'", "'x/t'"]),
    ("data.edit_kinds={move=2}", ["data.edit_kinds", "'move'", "position"]),
    ("data.edit_kinds={position=\"a\"}", ["data.edit_kinds.position", "'a'", "number"]),
    ("data.edit_kinds={position=-1}", ["data.edit_kinds", ">= 0"]),
    ("data.edit_kinds=2", ["data.edit_kinds", "table"]),
    ("train.compile=1", ["train.compile", "true or false"]),
    ("train.nope=1", ["train.nope", "unknown key"]),
    ("nope.lr=1", ["[nope]", "unknown section"]),
    ("model.heads=5", ["model.hidden", "divisible", "model.heads"]),
    ("model.axes_dims_rope=[8, 8, 8]", ["axes_dims_rope", "head dim"]),
    ("lr=1", ["expected section.key=value"]),
])
def test_bad_values_name_key_value_and_expectation(override, words):
    with pytest.raises(UserError) as e:
        load_config(REPO_CONFIGS / "shapes-tiny.toml", [override])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nlr = ")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[train]\nlearning_rate = 1e-4\n")
    with pytest.raises(UserError, match=r"unknown.toml: train.learning_rate: unknown key"):
        load_config(unknown)


def test_param_counts_of_large_presets_on_meta():
    flux = num_params(build_dit(config_dit_params(load_config(REPO_CONFIGS / "flux-dev.toml")), device="meta"))
    assert abs(flux - 11.9e9) / 11.9e9 < 0.01
    big = num_params(build_dit(config_dit_params(load_config(REPO_CONFIGS / "dit-24b.toml")), device="meta"))
    assert big >= 20e9


def test_config_show_json_has_num_params(capsys):
    assert main(["config", "show", "flux-dev", "--json", "--set", "train.lr=3e-5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["train"]["lr"] == 3e-5
    assert abs(out["num_params"] - 11_901_408_320) < 1e6
    # FLUX.1-dev as its users sample it: embedded guidance 3.5, every caption padded to 512 tokens and attended.
    assert out["sample"]["guidance"] == 3.5 and out["text"]["padding"] == "padded"


def test_config_show_reports_user_error_in_one_line(capsys):
    assert main(["config", "show", "flux-dev", "--set", "train.lr=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "train.lr" in err[0]


def test_presets_ship_inside_a_non_editable_install(tmp_path):
    """A wheel carries the presets, and the installed package finds them by name (not via the source tree)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "w"), str(root)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "w").glob("difftrain-*.whl")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    code = ("import difftrain.config as c; from difftrain.config import load_config, preset_path; "
            "print(c.__file__); [print(preset_path(n)) for n in ('shapes-tiny', 'flux-dev', 'dit-24b')]; "
            "load_config(preset_path('flux-dev'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, check=True).stdout.split()
    assert all(line.startswith(str(site)) for line in out), out


def test_extends_starts_from_a_preset_or_a_file_and_refuses_cycles(tmp_path):
    from difftrain.config import load_config

    base = tmp_path / "base.toml"
    base.write_text('extends = "shapes-store"\n[train]\nlr = 0.01\n[data]\nstore = "s1"\n')
    mine = tmp_path / "mine.toml"
    mine.write_text('extends = "base.toml"\ndata.sources = [{path = "photos"}]\n[train]\nsteps = 7\n')
    cfg = load_config(mine)
    assert (cfg.train.lr, cfg.train.steps, cfg.data.store) == (0.01, 7, "s1")     # tables merge key by key
    assert cfg.data.sources == [{"path": "photos"}]                                # arrays replace
    assert cfg.model.hidden == 192 and len(cfg.data.stages) == 2                   # the preset's, untouched
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n')
    with pytest.raises(UserError, match="makes a cycle"):
        load_config(tmp_path / "a.toml")
    (tmp_path / "c.toml").write_text('extends = "no-such-preset"\n')
    with pytest.raises(UserError, match=r"c.toml: extends = 'no-such-preset'.*not found"):
        load_config(tmp_path / "c.toml")
    (tmp_path / "d.toml").write_text("extends = 3\n")
    with pytest.raises(UserError, match="extends = 3: expected a preset name"):
        load_config(tmp_path / "d.toml")


def test_a_source_table_needs_only_its_path():
    from difftrain.data.prepare.ingest import normalize_spec

    assert normalize_spec({"path": "data/my-photos/"}) == {"path": "data/my-photos/", "kind": "folder",
                                                            "name": "my-photos"}
    assert normalize_spec({"path": "x", "kind": "edit", "name": "n"}) == {"path": "x", "kind": "edit", "name": "n"}


@pytest.mark.parametrize("value,message", [("0.5", ">= 1"), ("101", "<= 100"), ('"x"', "expected a number")])
def test_edit_changed_weight_out_of_range_is_refused_naming_the_key(value, message):
    from difftrain.config import load_config, preset_path
    from difftrain.errors import UserError

    with pytest.raises(UserError, match=rf"data.edit_changed_weight = .*{message}"):
        load_config(preset_path("shapes-tiny"), [f"data.edit_changed_weight={value}"])
    assert load_config(preset_path("shapes-tiny"), ["data.edit_changed_weight=8"]).data.edit_changed_weight == 8.0
