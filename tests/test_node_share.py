"""A quantized frozen base is read once per node: 4 gloo ranks as 2 nodes of 2 (``LOCAL_WORLD_SIZE=2``) each read about
half the quantized layers, quantize them and send them to the node's other rank; every rank ends with the layers a
single process quantizes, bit for bit, and the bytes a node reads from the base's files are the file once."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from difftrain.cli import main
from difftrain.config import load_config, to_toml

from conftest import TINY

pytest.importorskip("torchao")

WIDE = TINY + ["model.hidden=128", "model.axes_dims_rope=[16, 24, 24]", "model.double_blocks=2",
               "model.single_blocks=2", "model.init=default", "train.global_batch=4", "train.threads=1",
               "train.ema_decay=0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(cfg, env=None) -> tuple[dict, dict]:
    """The policy through the factory (as the trainer builds it): its quantized layers' digests and the read's report."""
    from difftrain.models import build_autoencoder, build_text_encoder
    from difftrain.models.base_quant import dequantized
    from difftrain.shapes.captions import vocabulary
    from difftrain.train.adapters import check_adapter_config
    from difftrain.train.build import Weights, build_model

    device = torch.device("cpu")
    ae = build_autoencoder(cfg.autoencoder.kind, cfg.autoencoder.factor)
    text = build_text_encoder(cfg, vocabulary(), device)
    built = build_model(cfg, "policy", device=device, text_encoder=text, autoencoder=ae, env=env,
                        weights=Weights.base(cfg.model.init_from), adapter=check_adapter_config(cfg))
    digests = {}
    for name, layer in built.quantized.items():
        w = layer.weight
        plain = type(w) is torch.Tensor or type(w) is torch.nn.Parameter
        digests[name] = [type(w).__name__, hashlib.sha256(
            (w.detach() if plain else dequantized(w, torch.float32)).contiguous().numpy().tobytes()).hexdigest()]
        assert not w.is_meta
    return digests, built.report


def _worker(rank: int, world: int, port: int, cfg_path: str, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % 2),
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from difftrain.config import load_config
    from difftrain.parallel.dist import init_distributed, shutdown

    cfg = load_config(cfg_path)
    env = init_distributed(cfg)
    try:
        digests, report = _build(cfg, env)
        Path(out, f"{rank}.json").write_text(json.dumps({"digests": digests, "report": report}))
        import torch.distributed as dist
        dist.barrier()
    finally:
        shutdown(True)


@pytest.mark.parametrize("precision", ["fp8", "nf4"])
def test_a_node_reads_the_quantized_base_once_and_every_rank_holds_it_whole(tmp_path, precision):
    (tmp_path / "base.toml").write_text(to_toml(load_config(None, WIDE + ["train.steps=1", "train.checkpoint_every=0"])))
    assert main(["train", str(tmp_path / "base.toml"), "--run-dir", str(tmp_path / "base"), "--no-progress"]) == 0
    base = tmp_path / "base" / "export"
    cfg_path = tmp_path / "lora.toml"
    cfg_path.write_text(to_toml(load_config(None, WIDE + [
        "adapter.kind=lora", "adapter.rank=4", "adapter.alpha=4", f"adapter.base_precision={precision}",
        f"model.init_from={base}"])))
    alone, report = _build(load_config(str(cfg_path)))
    assert len(alone) == 26 and all(kind != "Tensor" for kind, _ in alone.values()), alone
    file_bytes = sum(f.stat().st_size for f in base.glob("*.safetensors"))

    out = tmp_path / "ranks"
    out.mkdir()
    mp.spawn(_worker, args=(4, _free_port(), str(cfg_path), str(out)), nprocs=4, join=True)
    ranks = [json.loads((out / f"{r}.json").read_text()) for r in range(4)]
    for r in ranks:                       # every rank holds every layer, as one process quantizes it
        assert r["digests"] == alone
        assert r["report"]["node_bytes_received"] > 0
    for node in ((0, 1), (2, 3)):
        read = sum(ranks[r]["report"]["bytes_read"] for r in node)
        # the base once (its header and the index apart): each quantized layer by one rank of the node, the rest
        # (sharded over all 4 ranks) half by this node
        assert read <= 1.0 * file_bytes, (read, file_bytes)
        quantized_share = [ranks[r]["report"]["tensors"] for r in node]
        assert all(n < report["tensors"] for n in quantized_share), (quantized_share, report["tensors"])
    # one process reads every byte of the model's tensors: a node reads more than half of that (the quantized layers
    # whole), less than all of it
    assert 0.5 * report["bytes_read"] < read < report["bytes_read"], (read, report["bytes_read"])
