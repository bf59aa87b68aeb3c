"""The launch examples in deploy/ stay runnable: their torchrun command lines parse.

Nothing is launched. The SLURM script runs under bash with ``srun``/``scontrol`` stubbed and the
environment SLURM would give it (built from its own #SBATCH lines); the PyTorchJob's container
command gets the PET_* variables the Kubeflow operator would set. Each resulting command line
goes through one checker, ``check_torchrun_command``: torchrun's own parser and launch config,
then ``difftrain``'s parser, config resolution and ``--set`` syntax.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from difftrain.cli import build_parser, resolve_config
from difftrain.config import load_config
from difftrain.config.load import parse_override
from difftrain.errors import UserError
from difftrain.parallel.dist import resolve_mesh

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "deploy" / "slurm" / "train.sbatch"
PYTORCHJOB = ROOT / "deploy" / "k8s" / "pytorchjob.yaml"

# Known keys whose values must come out as integers (a leftover "$VAR" or "$(VAR)" would be read
# as a bare string), and the allowed values of the one string-valued mesh key.
INT_KEYS = {"parallel.dp_replicate", "parallel.dp_shard", "parallel.cp", "train.global_batch",
            "train.micro_batch"}
BACKENDS = {"auto", "nccl", "gloo"}


@dataclass
class Launch:
    prefix: list[str]                 # tokens before torchrun (srun and its options)
    torchrun: argparse.Namespace      # torchrun's parsed arguments
    launch: object                    # torch.distributed.launcher.api.LaunchConfig
    train: argparse.Namespace         # difftrain's parsed arguments
    config: Path                      # the config file CONFIG resolves to
    overrides: dict[str, object]      # "section.key" -> value, as --set reads it


def _parse(parser: argparse.ArgumentParser, argv: list[str], what: str) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit:
        raise AssertionError(f"{what} rejects {shlex.join(argv)}:\n{err.getvalue()}") from None


def _option_strings(*parsers: argparse.ArgumentParser) -> set[str]:
    return {s for p in parsers for a in p._actions for s in a.option_strings}


def _check_exact_options(tokens: list[str], known: set[str], what: str) -> None:
    """argparse accepts unambiguous prefixes (``--nproc-per-nod``); a launch file should not."""
    for tok in tokens:
        if tok.startswith("-") and not re.fullmatch(r"-\d+", tok):
            name = tok.split("=", 1)[0]
            assert name in known, f"{what}: {tok!r} is not an exact option name"


def _mesh_fits(config: Path, sets: list[str], world: int) -> bool:
    """The config's parallel.* sizes, with the command's --set items, resolve on a world of ``world`` ranks
    (the same check ``difftrain train`` makes before it allocates anything)."""
    try:
        par = load_config(config, sets).parallel
        resolve_mesh({"dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard, "cp": par.cp}, world)
    except UserError:
        return False
    return True


def node_group(launch) -> int:
    """GPUs in one shard group (dp_shard x cp) of the launched config."""
    par = load_config(launch.config, list(launch.train.overrides)).parallel
    return par.dp_shard * par.cp


def check_torchrun_command(argv: list[str], env: dict[str, str] | None = None) -> Launch:
    """Check one ``[launcher ...] torchrun ... -m difftrain train ...`` command line; return what
    it parsed to, or raise AssertionError. ``env`` is the environment torchrun would see (its
    parser takes defaults from PET_* variables)."""
    from torch.distributed import run as torchrun

    assert "torchrun" in argv, f"no torchrun in {shlex.join(argv)}"
    t = argv.index("torchrun")
    prefix, rest = argv[:t], argv[t + 1:]

    clean = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    with mock.patch.dict(os.environ, {**clean, **(env or {})}, clear=True):
        parser = torchrun.get_args_parser()
        ns = _parse(parser, rest, "torchrun")
        try:
            launch, _, _ = torchrun.config_from_args(ns)
        except Exception as e:   # torchrun's own checks (nnodes format, restarts, nproc...)
            raise AssertionError(f"torchrun launch config from {shlex.join(rest)}: {e}") from None
    n_torchrun = len(rest) - len(ns.training_script_args) - 1
    _check_exact_options(rest[:n_torchrun], _option_strings(parser), "torchrun")
    assert ns.module and ns.training_script == "difftrain", (
        f"expected `torchrun ... -m difftrain ...`, got script {ns.training_script!r} "
        f"(module={ns.module})")
    assert ns.rdzv_backend == "c10d" and ns.rdzv_endpoint, (
        f"expected a c10d rendezvous with an endpoint, got {ns.rdzv_backend!r} at {ns.rdzv_endpoint!r}")

    args = ns.training_script_args
    dparser = build_parser()
    train = _parse(dparser, args, "difftrain")
    assert train.verb == "train", f"expected `difftrain train`, got {train.verb!r}"
    sub = next(a for a in dparser._actions if isinstance(a, argparse._SubParsersAction))
    _check_exact_options(args, _option_strings(dparser, sub.choices["train"]), "difftrain train")
    try:
        config = resolve_config(train.config)
    except Exception as e:
        raise AssertionError(f"config {train.config!r}: {e}") from None

    overrides: dict[str, object] = {}
    for item in train.overrides:
        try:
            path, value = parse_override(item)
        except Exception as e:
            raise AssertionError(str(e)) from None
        key = ".".join(path)
        if key in INT_KEYS:
            assert isinstance(value, int) and not isinstance(value, bool), f"--set {item!r}: not an integer"
        if key == "parallel.backend":
            assert value in BACKENDS, f"--set {item!r}: expected one of {sorted(BACKENDS)}"
        overrides[key] = value

    for nodes in range(launch.min_nodes, launch.max_nodes + 1):
        world = nodes * launch.nproc_per_node
        assert _mesh_fits(config, list(train.overrides), world), (
            f"parallel degrees {overrides} do not fit {nodes} nodes x {launch.nproc_per_node} = {world} ranks")
    return Launch(prefix, ns, launch, train, config, overrides)


# --- SLURM ----------------------------------------------------------------------------------

def sbatch_directives(text: str) -> dict[str, str]:
    """The script's #SBATCH options (``--key[=value]``); fails on any that sbatch would ignore
    because it comes after the first command."""
    out, started = {}, False
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("#SBATCH"):
            assert not started, f"line {n}: #SBATCH after the first command is ignored by sbatch"
            for tok in shlex.split(s[len("#SBATCH"):]):
                assert tok.startswith("--"), f"line {n}: unexpected #SBATCH token {tok!r}"
                key, _, value = tok[2:].partition("=")
                out[key] = value
        elif s and not s.startswith("#"):
            started = True
    return out


def run_sbatch(script: Path, tmp_path: Path, env: dict[str, str] | None = None,
               args: tuple[str, ...] = (), unset: tuple[str, ...] = (), status: int = 0) -> tuple[list[str], dict[str, str]]:
    """Run the batch script as SLURM would on the head node, with ``srun`` and ``scontrol``
    stubbed; return the srun command line and the environment srun was called with. ``status``: the
    script's expected exit status."""
    d = sbatch_directives(script.read_text())
    nodes = int(d["nodes"])
    slurm = {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": d.get("job-name", "job"),
        "SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": f"gpu[{1:03d}-{nodes:03d}]",
        "SLURM_GPUS_ON_NODE": d["gpus-per-node"], "SLURM_CPUS_PER_TASK": d["cpus-per-task"],
        "SLURM_SUBMIT_DIR": str(tmp_path),
    }
    for var in unset:
        del slurm[var]
    capture, capture_env = tmp_path / "srun.argv", tmp_path / "srun.env"
    stubs = f"""
scontrol() {{
    if [[ $# -eq 2 && $1 == requeue ]]; then echo "$2" > {shlex.quote(str(tmp_path / "requeued"))}; return 0; fi
    [[ $# -eq 3 && $1 == show && $2 == hostnames && $3 == "$SLURM_JOB_NODELIST" ]] || {{
        echo "scontrol stub: unexpected arguments: $*" >&2; return 1; }}
    for i in $(seq 1 "$SLURM_NNODES"); do printf 'gpu%03d\\n' "$i"; done
}}
srun() {{
    printf '%s\\0' srun "$@" > {shlex.quote(str(capture))}; env -0 > {shlex.quote(str(capture_env))}
    if [[ -n ${{STUB_PREEMPTED_MARKER:-}} ]]; then echo '{{"step": 7}}' > "$STUB_PREEMPTED_MARKER"; fi
    return "${{STUB_SRUN_STATUS:-0}}"
}}
source "$0" "$@"
"""
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C"}
    proc = subprocess.run(["bash", "-c", "set -u\n" + stubs, str(script), *args],
                          env={**base, **slurm, **(env or {})}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    if status == 0:
        assert proc.returncode == 0, f"{script.name} failed under bash:\n{proc.stderr}"
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert capture.exists(), f"{script.name} never called srun"
    seen = dict(kv.split("=", 1) for kv in capture_env.read_text().split("\0")[:-1])
    return capture.read_text().split("\0")[:-1], seen


def test_sbatch_is_valid_bash():
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_sbatch_directives():
    d = sbatch_directives(SBATCH.read_text())
    assert "requeue" in d
    assert d["ntasks-per-node"] == "1"            # one torchrun agent per node
    assert int(d["nodes"]) > 1 and int(d["gpus-per-node"]) >= 1
    assert re.fullmatch(r"(B:)?(USR1|USR2|TERM|\d+)@\d+", d["signal"]), d["signal"]


def test_sbatch_launch_defaults(tmp_path):
    argv, env = run_sbatch(SBATCH, tmp_path)
    d = sbatch_directives(SBATCH.read_text())
    nodes, gpus = int(d["nodes"]), int(d["gpus-per-node"])
    got = check_torchrun_command(argv, env)

    assert got.prefix[0] == "srun"
    assert got.torchrun.nnodes == str(nodes)
    assert got.launch.min_nodes == got.launch.max_nodes == nodes
    assert got.launch.nproc_per_node == gpus
    assert got.torchrun.rdzv_endpoint == "gpu001:29500"        # the first host of the allocation
    assert got.torchrun.rdzv_id == env["SLURM_JOB_ID"]
    assert got.torchrun.max_restarts == 3
    assert "SIGUSR1" in got.torchrun.signals_to_handle.split(",")   # --signal=USR1@... reaches workers
    assert got.train.config == "dit-24b" and got.config.name == "dit-24b.toml"
    assert got.train.run_dir == str(tmp_path / "runs" / f"{env['SLURM_JOB_NAME']}-4242")
    assert got.train.no_progress
    # the split within a node is the preset's; the signal's lead is what the run checks its preemption need against
    assert got.overrides == {"parallel.dp_replicate": nodes, "health.preempt_lead_s": 120}
    assert node_group(got) == gpus
    assert Path(got.train.run_dir).is_dir()
    # What the workers inherit: their share of the cores, and the NCCL flight recorder dumping
    # into the run directory.
    assert int(env["OMP_NUM_THREADS"]) == int(d["cpus-per-task"]) // gpus
    assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith(got.train.run_dir + "/")
    assert int(env["TORCH_FR_BUFFER_SIZE"]) > 0


def test_sbatch_launch_env_and_extra_args(tmp_path):
    run_dir = tmp_path / "shared" / "flux"
    argv, env = run_sbatch(SBATCH, tmp_path,
                           env={"CONFIG": "flux-dev", "RUN_DIR": str(run_dir), "GPUS_PER_NODE": "4",
                                "RDZV_PORT": "29611", "MAX_RESTARTS": "0"},
                           args=("--set", "train.global_batch=512", "--set", "parallel.backend=nccl",
                                 "--set", "parallel.cp=1"))
    got = check_torchrun_command(argv, env)
    assert got.launch.nproc_per_node == 4
    assert got.torchrun.rdzv_endpoint == "gpu001:29611"
    assert got.torchrun.max_restarts == 0
    assert got.train.config == "flux-dev" and got.train.run_dir == str(run_dir)
    assert node_group(got) == 4                  # flux-dev's dp_shard 4 x cp 1 on 4-GPU nodes
    assert got.overrides["train.global_batch"] == 512
    assert got.overrides["parallel.backend"] == "nccl"


def test_sbatch_requeues_only_after_a_preemption(tmp_path):
    run_dir = tmp_path / "run"
    run_sbatch(SBATCH, tmp_path, env={"RUN_DIR": str(run_dir)})
    assert not (tmp_path / "requeued").exists()              # a finished (or failed) run is not requeued
    # the trainer stopped for SIGUSR1/SIGTERM and left its marker while srun ran: the job requeues itself
    run_sbatch(SBATCH, tmp_path, env={"RUN_DIR": str(run_dir), "STUB_PREEMPTED_MARKER": str(run_dir / "requeue.json")})
    assert (tmp_path / "requeued").read_text().strip() == "4242"


def test_sbatch_requeues_a_preemption_whatever_srun_returns_and_passes_failures_on(tmp_path):
    """A signalled torchrun agent exits non-zero after its workers checkpointed: the marker decides, not the
    status. Without a marker a failure is the job's failure (not requeued)."""
    run_dir = tmp_path / "run"
    marker = {"STUB_PREEMPTED_MARKER": str(run_dir / "requeue.json")}
    run_sbatch(SBATCH, tmp_path, env={"RUN_DIR": str(run_dir), "STUB_SRUN_STATUS": "1", **marker})
    assert (tmp_path / "requeued").read_text().strip() == "4242"
    (tmp_path / "requeued").unlink()
    (run_dir / "requeue.json").unlink()
    run_sbatch(SBATCH, tmp_path, env={"RUN_DIR": str(run_dir), "STUB_SRUN_STATUS": "3"}, status=3)
    assert not (tmp_path / "requeued").exists()


@pytest.mark.parametrize("measured, lead, expected", [(None, None, 120), (40, None, 40), (500, None, 120),
                                                      (40, "30", 30), (None, "600", 600)])
def test_sbatch_shutdown_timeout_is_the_measured_need_within_the_signal_lead(tmp_path, measured, lead, expected):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if measured is not None:
        (run_dir / "preemption.json").write_text(json.dumps({"step": 8, "lead_needed_s": measured - 0.4,
                                                             "shutdown_timeout_s": measured}))
    env = {"RUN_DIR": str(run_dir), **({"SIGNAL_LEAD_S": lead} if lead else {})}
    argv, _ = run_sbatch(SBATCH, tmp_path, env=env)
    assert argv[argv.index("--shutdown-timeout") + 1] == str(expected)
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert f"health.preempt_lead_s={lead or 120}" in sets


def test_sbatch_typo_is_caught(tmp_path):
    """The SLURM path can fail: a misspelled torchrun flag in a copy of the script."""
    broken = tmp_path / "broken.sbatch"
    text = SBATCH.read_text()
    assert "--rdzv-endpoint" in text
    broken.write_text(text.replace("--rdzv-endpoint", "--rdzv-endpont"))
    argv, env = run_sbatch(broken, tmp_path)
    with pytest.raises(AssertionError, match="torchrun rejects"):
        check_torchrun_command(argv, env)


def test_sbatch_needs_slurm_environment(tmp_path):
    """set -u: outside a SLURM job (here: no SLURM_NNODES) the script stops instead of launching."""
    with pytest.raises(AssertionError, match="failed under bash"):
        run_sbatch(SBATCH, tmp_path, unset=("SLURM_NNODES",))


# --- Kubernetes -----------------------------------------------------------------------------

def operator_env(job: dict) -> dict[str, str]:
    """The PET_* variables the Kubeflow Training Operator gives each worker of an elastic job."""
    policy = job["spec"]["elasticPolicy"]
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    container = next(c for c in worker["template"]["spec"]["containers"] if c["name"] == "pytorch")
    port = policy.get("rdzvPort") or next(
        p["containerPort"] for p in container.get("ports", []) if p["name"] == "pytorchjob-port")
    env = {
        "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
        "PET_RDZV_ENDPOINT": f"{policy.get('rdzvHost', job['metadata']['name'] + '-worker-0')}:{port}",
        "PET_NNODES": (f"{policy['minReplicas']}:{policy['maxReplicas']}"
                       if "minReplicas" in policy or "maxReplicas" in policy else str(worker["replicas"])),
    }
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "nprocPerNode" in job["spec"]:
        env["PET_NPROC_PER_NODE"] = str(job["spec"]["nprocPerNode"])
    return env


def pod_env(job: dict, container: dict) -> dict[str, str]:
    """The environment torchrun sees in a worker pod: the container's env plus the operator's."""
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e} | operator_env(job)


def _container_argv(container: dict) -> list[str]:
    argv = [str(a) for a in container.get("command", []) + container.get("args", [])]
    # Kubernetes expands $(VAR) in command/args only for variables it knows; keep it out of here.
    assert not any("$(" in a for a in argv), argv
    return argv


@pytest.fixture
def job():
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(PYTORCHJOB.read_text())


def test_pytorchjob_launch(job):
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    spec = job["spec"]
    policy = spec["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d"
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert policy["minReplicas"] <= worker["replicas"] <= policy["maxReplicas"]
    pod = worker["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "pytorch"]

    got = check_torchrun_command(_container_argv(container), env=pod_env(job, container))
    assert got.prefix == []
    assert (got.launch.min_nodes, got.launch.max_nodes) == (policy["minReplicas"], policy["maxReplicas"])
    assert got.launch.max_restarts == policy["maxRestarts"]
    assert got.torchrun.rdzv_endpoint == f"{job['metadata']['name']}-worker-0:29500"
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert got.launch.nproc_per_node == gpus
    assert node_group(got) == gpus               # shard within a pod, replicate across pods
    assert got.train.config == "dit-24b" and got.train.no_progress
    # The NCCL flight recorder dumps into the run directory.
    env = pod_env(job, container)
    assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith(got.train.run_dir + "/")
    # A replacement pod can rejoin a later rendezvous round (tests/test_node_loss.py runs the agents so).
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"

    # The run directory sits on a volume every pod mounts, backed by a shared claim.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    run_dir = Path(got.train.run_dir)
    mount = next((Path(p) for p in mounts if run_dir.is_relative_to(p)), None)
    assert mount is not None, f"--run-dir {run_dir} is not on a mounted volume"
    vol = next(v for v in pod["volumes"] if v["name"] == mounts[str(mount)])
    assert "persistentVolumeClaim" in vol

    # Preemption: the run is told the lead it has (the grace period), and torchrun gives its workers a little
    # less than that before it kills them; both above torchrun's default of 30 s.
    grace = int(pod["terminationGracePeriodSeconds"])
    assert got.overrides["health.preempt_lead_s"] == grace
    assert 30 < got.torchrun.shutdown_timeout < grace
    assert got.overrides["health.preempt_exit_code"] != 0      # a pod that exits 0 counts as done


def test_pytorchjob_typo_is_caught(job):
    """The Kubernetes path can fail: a misspelled difftrain flag in the container command."""
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    argv = ["--run_dir" if a == "--run-dir" else a for a in _container_argv(container)]
    with pytest.raises(AssertionError, match="difftrain rejects"):
        check_torchrun_command(argv, env=pod_env(job, container))


# --- the checker itself ---------------------------------------------------------------------

ENV = {"OMP_NUM_THREADS": "1"}
GOOD = ("torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint h:29500 "
        "-m difftrain train shapes-tiny --no-progress --set parallel.dp_replicate=2 --set parallel.dp_shard=8")


def test_checker_accepts_good_command():
    got = check_torchrun_command(shlex.split(GOOD), ENV)
    assert got.overrides == {"parallel.dp_replicate": 2, "parallel.dp_shard": 8}


@pytest.mark.parametrize("old,new,match", [
    ("--rdzv-endpoint", "--rdzv-endpont", "torchrun rejects"),             # unknown torchrun flag
    ("--nproc-per-node", "--nproc-per-nod", "not an exact option"),        # argparse prefix match
    ("--nnodes 2", "--nnodes 2:1", "min_nodes"),                           # torchrun's own check
    ("-m difftrain", "difftrain", "expected `torchrun ... -m difftrain"),   # script, not module
    ("-m difftrain", "-m difftrian", "expected `torchrun ... -m difftrain"),
    ("--rdzv-backend c10d", "--rdzv-backend static", "c10d rendezvous"),
    (" train ", " trian ", "difftrain rejects"),                           # unknown verb
    ("--no-progress", "--no-prog", "not an exact option"),                 # prefix of a train flag
    ("--no-progress", "--no_progress", "difftrain rejects"),
    ("shapes-tiny", "shapes-huge", "config 'shapes-huge'"),                # no such preset
    ("parallel.dp_shard=8", "parallel.dp_shard", "expected section.key=value"),
    ("parallel.dp_shard=8", "dp_shard=8", "one dot"),
    ("parallel.dp_replicate=2", "parallel.dp_replicate=$SLURM_NNODES", "not an integer"),
    ("parallel.dp_replicate=2", "parallel.dp_replicate=4", "do not fit"),  # 4 x 8 != 2 nodes x 8
    ("parallel.dp_replicate=2", "parallel.dp_replicate=-1 --set parallel.cp=-1", "do not fit"),
])
def test_checker_rejects_broken_command(old, new, match):
    assert old in GOOD
    with pytest.raises(AssertionError, match=re.escape(match)):
        check_torchrun_command(shlex.split(GOOD.replace(old, new, 1)), ENV)


def test_checker_needs_torchrun():
    with pytest.raises(AssertionError, match="no torchrun"):
        check_torchrun_command(shlex.split(GOOD.replace("torchrun", "python", 1)), ENV)
