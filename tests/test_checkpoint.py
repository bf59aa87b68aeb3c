import json
from pathlib import Path

import pytest
import torch

from difftrain.errors import UserError
from difftrain.train import faults
from difftrain.train.checkpoint import FORMAT, MARKER, Checkpointer, verify
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
    path = ck.save(3, m, opt, ema, {"loader": {"step": 3}, "ema_updates": ema.updates}).path

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
    path = Checkpointer(tmp_path).save(1, m, None, None, {}).path
    names = sorted(p.name for p in path.iterdir())
    assert all(n.endswith((".safetensors", ".json")) for n in names), names
    assert json.loads((path / "trainer.json").read_text())["format"] == FORMAT
    marker = json.loads((path / MARKER).read_text())
    assert set(marker["files"]) == set(names) - {MARKER} and verify(path) is None


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
    path = Checkpointer(tmp_path).save(1, _model(), None, None, {}).path
    other = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 5), "b": torch.nn.Linear(5, 2)})
    with pytest.raises(UserError, match="does not match"):
        Checkpointer.load(path, other)


def test_async_save_snapshot_is_not_torn_by_the_next_step(tmp_path):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _train(m, opt)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ck = Checkpointer(tmp_path, async_save=True)
    res = ck.save(3, m, opt, None, {})
    ck.wait_staged()                          # what the trainer does before its next optimizer step
    with torch.no_grad():                     # the next optimizer step changes the weights in place
        for p in m.parameters():
            p.mul_(-3.0).add_(7.0)
    done = ck.wait()
    assert done.error is None and res.stall_s >= 0 and done.write_s >= res.stall_s
    m2 = _model()
    Checkpointer.load(ck.latest(), m2)
    for k, v in m2.state_dict().items():
        assert torch.equal(v, before[k]), k
    ck.close()


def test_marker_missing_or_checksum_wrong_falls_back_to_previous(tmp_path):
    m = _model()
    events = []
    ck = Checkpointer(tmp_path, keep=5, on_event=lambda kind, step, **i: events.append((kind, step)))
    for s in (1, 2, 3):
        ck.save(s, m, None, None, {})
    d = tmp_path / "checkpoints"
    # a flipped byte in the newest: reported, set aside (not deleted), the previous one is used
    f = next((d / "step_00000003").glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    assert "checksum" in verify(d / "step_00000003")
    assert ck.latest().name == "step_00000002"
    assert (d / "step_00000003.bad").is_dir() and ("checkpoint_skipped", 3) in events
    # no marker (a save killed before sealing, renamed by hand): skipped too
    (d / "step_00000002" / MARKER).unlink()
    assert ck.latest().name == "step_00000001"
    with pytest.raises(UserError, match="not a complete checkpoint"):
        Checkpointer.read_info(d / "step_00000002")
    # a truncated file fails on its size without reading it
    g = next((d / "step_00000001").glob("*.safetensors"))
    g.write_bytes(g.read_bytes()[:10])
    assert "bytes" in verify(d / "step_00000001", checksums=False)
    assert ck.latest() is None


def test_retention_keeps_last_k_and_every_nth(tmp_path):
    m = _model()
    ck = Checkpointer(tmp_path, keep=2, keep_every=4)
    for s in range(1, 10):
        ck.save(s, m, None, None, {})
    assert [int(p.name[5:]) for p in ck.complete_steps()] == [4, 8, 9]
    ck2 = Checkpointer(tmp_path / "b", keep=2)
    for s in range(1, 4):
        ck2.save(s, m, None, None, {})
    assert [int(p.name[5:]) for p in ck2.complete_steps()] == [2, 3]


@pytest.mark.parametrize("kind", ["enospc", "erofs"])
@pytest.mark.parametrize("async_save", [False, True])
def test_write_failure_leaves_previous_checkpoint_intact(tmp_path, monkeypatch, kind, async_save):
    m = _model()
    monkeypatch.setenv("DIFFTRAIN_FAULTS", f"{kind}@2")
    faults.configure(tmp_path, 0)
    events = []
    ck = Checkpointer(tmp_path, async_save=async_save, on_event=lambda k, s, **i: events.append((k, s, i)))
    ck.save(1, m, None, None, {})
    ck.wait()
    if async_save:
        ck.save(2, m, None, None, {})
        assert ck.wait().error is not None
    else:
        with pytest.raises(UserError, match="previous one is intact"):
            ck.save(2, m, None, None, {})
    d = tmp_path / "checkpoints"
    assert ck.latest().name == "step_00000001" and verify(d / "step_00000001") is None
    assert not (d / "step_00000002").exists() and not (d / "step_00000002.partial").exists()
    assert any(k == "checkpoint_failed" and s == 2 for k, s, _ in events)
    ck.save(3, m, None, None, {})          # the next save (the fault fired once) succeeds
    ck.wait()
    assert ck.latest().name == "step_00000003"
    monkeypatch.delenv("DIFFTRAIN_FAULTS")
    faults.configure(tmp_path, 0)
    ck.close()


def test_sampling_loads_the_checkpoint_into_the_models_own_parameters(tiny_cfg, tmp_path):
    """No second copy of the model while loading for sampling: the EMA weights are read into the parameters
    the pipeline's model already holds (same storage), and equal the checkpoint's."""
    from safetensors.torch import load_file

    from difftrain.inference import load_pipeline
    from difftrain.train import build_trainer
    from difftrain.train.checkpoint import Checkpointer

    tr = build_trainer(tiny_cfg("train.steps=2", "train.checkpoint_every=0"), tmp_path / "run")
    tr.fit()
    tr.close()
    info = Checkpointer.read_info(tmp_path / "run")
    stored = {}
    for f in sorted(Path(info["path"]).glob("*.safetensors")):
        stored.update({k[len("ema."):]: v for k, v in load_file(str(f)).items() if k.startswith("ema.")})
    into = {k: torch.zeros_like(v) for k, v in stored.items()}
    ptrs = {k: v.data_ptr() for k, v in into.items()}
    out = Checkpointer.load_tensors(tmp_path / "run", "ema", into)
    assert out is into and {k: v.data_ptr() for k, v in into.items()} == ptrs
    assert all(torch.equal(into[k], stored[k]) for k in stored)
    pipe, _, _ = load_pipeline(tmp_path / "run")
    got = dict(pipe.model.named_parameters())
    assert set(got) == set(stored) and all(torch.equal(got[k], stored[k]) for k in stored)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_verify_shares_cover_every_piece_once_within_a_fair_share_plus_one_piece(world):
    """Pieces of 1 MB here: one 30 MB file (as a 24B model's largest shard is to its checkpoint) is shared out
    like the rest, so no rank reads more than 1/N of the bytes plus one piece; a marker of an earlier format
    (one CRC-32 a file) is shared by whole files."""
    import random

    from difftrain.train.verification import units, verify_shares

    rng = random.Random(world)
    mb = 10**6
    files = {f"f{i}": {"bytes": n, "piece_bytes": mb, "pieces": ["0"] * -(-n // mb)}
             for i, n in enumerate([30 * mb] + [rng.choice([10, 1000, mb // 2, 3 * mb]) for _ in range(22)])}
    shares = verify_shares(files, world)
    sizes = dict(units(files))
    assert len(shares) == world and sorted(u for s in shares for u in s) == sorted(sizes)      # each piece once
    total = sum(f["bytes"] for f in files.values())
    assert max(sum(sizes[u] for u in s) for s in shares) <= total / world + mb
    assert verify_shares(files, world) == shares                      # every rank computes the same
    old = {name: {"bytes": f["bytes"], "crc32": "0"} for name, f in files.items()}
    shares = verify_shares(old, world)
    assert sorted(u for s in shares for u in s) == sorted((n, None) for n in old)
    assert max(sum(old[n]["bytes"] for n, _ in s) for s in shares) <= total / world + 30 * mb


def _saved_and_largest(tmp_path):
    """A blocking save of a trained model; its path, the marker's files and the largest file's name."""
    from difftrain.train.checkpoint import MARKER

    ck = Checkpointer(tmp_path)
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _train(m, opt)
    path = ck.save(1, m, opt, EMA(m, 0.9), {"loader": {}}, blocking=True).path
    files = json.loads((path / MARKER).read_text())["files"]
    return path, files, max(files, key=lambda n: files[n]["bytes"])


def _flip_byte(f: Path, at: int) -> None:
    """Same size, other bytes: the byte at ``at`` inverted."""
    with f.open("r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_pieces_find_damage_where_it_is(tmp_path, monkeypatch):
    """With pieces smaller than the shard, a flipped byte is reported in the piece that holds it, and a share
    without that piece passes; the marker lists every piece's checksum, computed as the shard was written."""
    from difftrain.train import verification
    from difftrain.train.checkpoint import verify

    monkeypatch.setattr(verification, "PIECE", 256)
    path, files, target = _saved_and_largest(tmp_path)
    assert files[target]["piece_bytes"] == 256 and len(files[target]["pieces"]) == -(-files[target]["bytes"] // 256)
    assert files[target]["pieces"] == verification.file_digest(path / target, piece=256)["pieces"]
    assert not list(path.glob("*.digest"))
    at = files[target]["bytes"] - 10
    _flip_byte(path / target, at)
    k = at // 256
    assert k > 0
    assert verify(path, only={(target, k)}) == (f"{target} fails its CRC-32 checksum (piece {k}, bytes "
                                                f"{k * 256}..{k * 256 + 256})")
    assert verify(path, only={(target, 0)}) is None
    assert verify(path) is not None


def test_a_share_only_checksums_its_files_but_every_size_is_checked(tmp_path):
    from difftrain.train.checkpoint import verify

    path, files, target = _saved_and_largest(tmp_path)
    _flip_byte(path / target, files[target]["bytes"] // 2)
    assert verify(path, only={target}).startswith(f"{target} fails its CRC-32 checksum")
    assert verify(path, only=set(files) - {target}) is None           # another rank's share: not its business
    (path / target).write_bytes(b"short")
    assert "bytes, its marker says" in verify(path, only=set())       # sizes are everyone's


def test_a_shard_a_rank_wrote_but_the_listing_lacks_is_not_sealed(tmp_path, monkeypatch):
    """The seal lists the files the ranks' write results name, not what a directory listing shows: a file a
    stale listing omits stops the seal (the previous checkpoint stays the newest) instead of sealing without it."""
    from difftrain.train.checkpoint import StreamingSafetensorsWriter

    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ck = Checkpointer(tmp_path)
    first = ck.save(1, m, opt, None, {"loader": {}}, blocking=True).path
    real = StreamingSafetensorsWriter.finish

    def finish_seeing_a_phantom(self, metadata, results):
        out = real(self, metadata, results)
        self.written = self.written + ["model-00002-of-00002.safetensors"]    # written elsewhere, not listed
        return out

    monkeypatch.setattr(StreamingSafetensorsWriter, "finish", finish_seeing_a_phantom)
    with pytest.raises(UserError, match="checkpoint at step 2 failed, the previous one is intact: .*sealing the "
                                        "checkpoint failed \\(model-00002-of-00002.safetensors written by a rank but "
                                        "not in the directory"):
        ck.save(2, m, opt, None, {"loader": {}}, blocking=True)
    assert ck.latest() == first and not (tmp_path / "checkpoints" / "step_00000002.partial").exists()


def test_plain_reader_reads_rows_and_names_a_truncated_file(tmp_path):
    """Checkpoints are read with plain reads (no memory map): a request's rows, the other slices applied in
    memory, every dtype the trainer writes; a file cut short names the tensor that runs past its end."""
    from safetensors.torch import save_file
    from difftrain.parallel.reader import SafetensorsFile

    ts = {"a": torch.randn(7, 5, 3), "b": torch.randn(4).to(torch.bfloat16), "s": torch.tensor(3.5),
          "i": torch.arange(10)}
    path = tmp_path / "x.safetensors"
    save_file(ts, str(path))
    with SafetensorsFile(path) as f:
        assert torch.equal(f.read("a"), ts["a"])
        assert torch.equal(f.read("a", (slice(2, 5), slice(1, 3), slice(0, 3))), ts["a"][2:5, 1:3])
        assert torch.equal(f.read("b"), ts["b"]) and f.read("b").dtype == torch.bfloat16
        assert torch.equal(f.read("s"), ts["s"]) and torch.equal(f.read("i", (slice(3, 9),)), ts["i"][3:9])
        with pytest.raises(KeyError, match="no tensor 'c'"):
            f.read("c")
    data = path.read_bytes()
    path.write_bytes(data[:-8])
    with SafetensorsFile(path) as f, pytest.raises(ValueError, match=r"x.safetensors: tensor '.' ends past the end"):
        for name in ts:
            f.read(name)


def test_loading_a_model_maps_no_file_pages(tmp_path):
    """``load_tensors`` reads into the model's own parameters without mapping the checkpoint's files: none of
    them is among the process's mappings while the load reads (it would be with safetensors' safe_open)."""
    import torch.distributed.checkpoint as dcp
    from difftrain.parallel import reader

    dcp.save({"model.w": torch.randn(64, 32), "model.b": torch.randn(32)},
             storage_writer=dcp.HuggingFaceStorageWriter(str(tmp_path / "ck")))
    seen = []
    orig = reader.SafetensorsFile.read

    def spy(self, name, slices=(), out=None):
        seen.append(Path("/proc/self/maps").read_text().count(str(tmp_path / "ck")))
        return orig(self, name, slices, out)

    reader.SafetensorsFile.read = spy
    try:
        into = {"model.w": torch.zeros(64, 32), "model.b": torch.zeros(32)}
        dcp.load(into, storage_reader=reader.PlainReader(str(tmp_path / "ck")))
    finally:
        reader.SafetensorsFile.read = orig
    assert len(seen) == 2 and seen == [0, 0]
    assert into["model.w"].abs().sum() > 0


def test_plain_reader_reads_straight_into_a_matching_destination(tmp_path):
    from safetensors.torch import save_file
    from difftrain.parallel.reader import SafetensorsFile

    a = torch.randn(6, 4)
    save_file({"a": a}, str(tmp_path / "x.safetensors"))
    with SafetensorsFile(tmp_path / "x.safetensors") as f:
        out = torch.zeros(3, 4)
        assert f.read("a", (slice(2, 5), slice(0, 4)), out=out) is out and torch.equal(out, a[2:5])
        other = torch.zeros(3, 4, dtype=torch.bfloat16)        # another dtype: read, then copied by the caller
        got = f.read("a", (slice(2, 5), slice(0, 4)), out=other)
        assert got is not other and torch.equal(got, a[2:5]) and other.abs().sum() == 0
        part = torch.zeros(3, 2)                                # not whole rows: sliced in memory
        assert torch.equal(f.read("a", (slice(2, 5), slice(1, 3)), out=part), a[2:5, 1:3])


class _DeviceStandIn(torch.Tensor):
    """A tensor that behaves as a GPU shard where the writer could go wrong: it says it lives on cuda:0 and refuses
    ``.numpy()`` as a CUDA tensor does; every slice of it taken to copy a piece to the host is counted."""

    slices: list[int] = []

    @property
    def device(self):
        return torch.device("cuda", 0)

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() first.")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            cls.slices.append(1)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_writer_copies_a_device_shard_to_the_host_in_bounded_pieces(tmp_path, monkeypatch):
    """A blocking save hands the writer the live device shards: it copies each to the host itself, one bounded
    piece at a time (never ``.numpy()`` on a device tensor, never a full host copy), and the file reads back."""
    from types import SimpleNamespace

    from safetensors import safe_open

    from difftrain.train import checkpoint_write as ck

    chunk = 1024
    monkeypatch.setattr(ck, "_CHUNK", chunk)
    values = {"w": torch.randn(70, 33), "b": torch.arange(10, dtype=torch.bfloat16), "e": torch.zeros(0)}
    shards = {k: v.as_subclass(_DeviceStandIn) for k, v in values.items()}
    items = [SimpleNamespace(index=SimpleNamespace(fqn=k), tensor_data=SimpleNamespace(chunk=SimpleNamespace(
        offsets=[0] * v.dim()))) for k, v in values.items()]
    planner = SimpleNamespace(resolve_data=lambda wi: shards[wi.index.fqn])
    copies = []
    real_empty = torch.empty

    def empty(*shape, **kw):              # the host buffer the writer allocates: bounded by the chunk
        t = real_empty(*shape, **kw)
        copies.append(t.numel())
        return t
    monkeypatch.setattr(torch, "empty", empty)
    _DeviceStandIn.slices = []
    out = ck.StreamingSafetensorsWriter._write_file(
        tmp_path / "shard.safetensors", "shard.safetensors", items, planner,
        lambda name, offset, length: (name, offset, length),
        lambda index, size_in_bytes, storage_data: (index.fqn, size_in_bytes, storage_data),
        {"custom": None})
    monkeypatch.setattr(torch, "empty", real_empty)
    assert copies and max(copies) <= chunk                               # one buffer per shard, a chunk at most
    n_w = 70 * 33 * 4
    assert len(_DeviceStandIn.slices) >= -(-n_w // chunk)                # the big shard went over in pieces
    assert [o[:2] for o in out] == [("w", n_w), ("b", 20), ("e", 0)]
    with safe_open(str(tmp_path / "shard.safetensors"), "pt") as f:
        for k, v in values.items():
            assert torch.equal(f.get_tensor(k), v)
    from difftrain.train.verification import file_digest, read_sidecar
    assert read_sidecar(tmp_path / "shard.safetensors") == file_digest(tmp_path / "shard.safetensors")
