"""Loss masks from the user's data: read beside images (``NAME_mask.png``, an edit folder's ``mask.png``, a
manifest's ``mask`` column or the alpha channel), cut to tokens as the image is cut to its bucket, served as
``Batch.keep_BL`` and taken out of the flow loss and of its token count (fast: no Ray; the whole path through
``prepare`` and ``train`` is in test_prepare.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from difftrain.data.batch import assemble_packed
from difftrain.data.prepare.ingest import ALPHA, iter_source
from difftrain.data.prepare.job import _decode_batch, token_keep
from difftrain.data.store.loader import keep_mask
from difftrain.diffusion.flow import FlowSpec, flow_loss
from difftrain.errors import UserError
from difftrain.train.objectives import FlowMatching


def _left_half(w: int, h: int) -> Image.Image:
    a = np.zeros((h, w), np.uint8)
    a[:, : w // 2] = 255
    return Image.fromarray(a, "L")


def test_a_mask_is_cut_to_tokens_as_its_image_is_cut_to_the_bucket():
    # a 64x64 image into a 32x32 bucket, 16-pixel tokens: the left column of the 2x2 grid is kept
    keep = token_keep(_left_half(64, 64), (64, 64), 32, 32, 16, "center", 1)
    assert keep.tolist() == [True, False, True, False]
    # a 96x64 (wide) image centre-cropped to 32x32: the crop's middle third of the width; its left half is
    # x in [16, 32) of the 48-pixel-wide resize, which the crop [8, 40) holds as its columns 8..23: 16 of 32
    # pixels a row, so a token [0, 16) keeps 8/16 white (kept, half), [16, 32) none
    keep = token_keep(_left_half(96, 64), (96, 64), 32, 32, 16, "center", 1)
    assert keep.tolist() == [True, False, True, False]
    # a top band: rows are token rows (row-major token order)
    a = np.zeros((64, 64), np.uint8)
    a[:32] = 255
    assert token_keep(Image.fromarray(a, "L"), (64, 64), 32, 32, 16, "center", 1).tolist() == [True, True,
                                                                                                 False, False]


def test_bad_masks_are_refused_naming_the_problem():
    with pytest.raises(ValueError, match="mask is 32x32, its image 64x64"):
        token_keep(_left_half(32, 32), (64, 64), 32, 32, 16, "center", 1)
    with pytest.raises(ValueError, match="keeps no token"):
        token_keep(Image.new("L", (64, 64), 0), (64, 64), 32, 32, 16, "center", 1)


def _write(path, img: Image.Image) -> str:
    img.save(path)
    return str(path)


def test_folder_masks_are_read_beside_their_images_and_are_no_images_themselves(tmp_path):
    d = tmp_path / "imgs"
    d.mkdir()
    for name in ("a", "b"):
        _write(d / f"{name}.png", Image.new("RGB", (64, 64), (200, 10, 10)))
        (d / f"{name}.txt").write_text(f"photo {name}")
    _write(d / "a_mask.png", _left_half(64, 64))
    got = {s.key: s for s in iter_source({"name": "f", "kind": "folder", "path": str(d)})}
    assert sorted(got) == ["a", "b"]                       # a_mask.png is a's mask, not an image
    assert got["a"].mask.endswith("a_mask.png") and got["b"].mask == ""
    off = {s.key: s.mask for s in iter_source({"name": "f", "kind": "folder", "path": str(d), "mask": "none"})}
    assert off == {"a": "", "b": ""}
    alpha = {s.key: s.mask for s in iter_source({"name": "f", "kind": "folder", "path": str(d), "mask": "alpha"})}
    assert alpha == {"a": ALPHA, "b": ALPHA}
    with pytest.raises(UserError, match=r"data.sources\['f'\].mask: unknown mask 'sometimes'"):
        iter_source({"name": "f", "kind": "folder", "path": str(d), "mask": "sometimes"})
    with pytest.raises(UserError, match="keyframes source takes no mask"):
        iter_source({"name": "k", "kind": "keyframes", "path": str(d), "mask": "alpha"})


def test_edit_folders_and_manifests_name_the_targets_mask(tmp_path):
    e = tmp_path / "edits" / "one"
    e.mkdir(parents=True)
    for n in ("source", "target"):
        _write(e / f"{n}.png", Image.new("RGB", (32, 32)))
    _write(e / "mask.png", _left_half(32, 32))
    (e / "instruction.txt").write_text("make it red")
    [s] = list(iter_source({"name": "e", "kind": "edit", "path": str(tmp_path / "edits")}))
    assert s.mask.endswith("one/mask.png") and len(s.refs) == 2
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"image": "edits/one/target.png", "caption": "x", "mask": "edits/one/mask.png"}) + "\n"
                 + json.dumps({"image": "edits/one/source.png", "caption": "y"}) + "\n")
    rows = list(iter_source({"name": "m", "kind": "manifest", "path": str(m)}))
    assert rows[0].mask == str(tmp_path / "edits/one/mask.png") and rows[1].mask == ""
    assert "mask" not in rows[0].scores


def _decode(refs: list[str], mask: str, h: int = 32, w: int = 32) -> dict:
    batch = {"sample_id": [7], "table": ["low/32x32/t2i"], "source": ["s"], "key": ["k"], "caption": ["c"],
             "scores": ["{}"], "h": [h], "w": [w], "latent_dtype": ["bf16"], "refs": [refs], "crop": ["center"],
             "mask": [mask], "patch": [16]}
    return _decode_batch(batch)


def test_decoding_packs_the_mask_and_a_bad_mask_is_that_samples_error(tmp_path):
    img = _write(tmp_path / "a.png", Image.new("RGB", (64, 64), (1, 2, 3)))
    good = _write(tmp_path / "a_mask.png", _left_half(64, 64))
    out = _decode([img], good)
    assert out["error"] == [""]
    assert np.unpackbits(np.frombuffer(out["keep"][0], np.uint8), count=4).tolist() == [1, 0, 1, 0]
    assert _decode([img], "")["keep"] == [b""]
    small = _write(tmp_path / "small_mask.png", _left_half(32, 32))
    bad = _decode([img], small)
    assert "loss mask" in bad["error"][0] and "32x32" in bad["error"][0] and bad["pixels"] == [b""]
    # alpha: the target's own alpha channel; an image without one is that sample's error
    rgba = np.zeros((64, 64, 4), np.uint8)
    rgba[..., 3] = np.asarray(_left_half(64, 64))
    ra = _write(tmp_path / "rgba.png", Image.fromarray(rgba, "RGBA"))
    out = _decode([ra], ALPHA)
    assert np.unpackbits(np.frombuffer(out["keep"][0], np.uint8), count=4).tolist() == [1, 0, 1, 0]
    assert "no alpha channel" in _decode([img], ALPHA)["error"][0]


def test_the_loss_and_its_token_count_leave_masked_tokens_out():
    # 2 examples of 2 frames (edit: target, then reference) of 4 tokens; example 0 keeps its target's tokens 0, 2
    keep = keep_mask([np.packbits([1, 0, 1, 0]).tobytes(), b""], 2, 4)
    assert keep.tolist() == [[True, False, True, False, True, True, True, True], [True] * 8]
    assert keep_mask([b"", b""], 2, 4) is None
    # a transport that drops trailing zero bytes loses nothing: they are masked tokens either way
    assert keep_mask([b"\x80", b""], 1, 12)[0].tolist() == [True] + [False] * 11
    torch.manual_seed(0)
    x = torch.randn(2, 2, 4, 8)
    target = torch.tensor([[True, False], [True, False]])
    b = assemble_packed(x, 4, 4, [0, 1], target, {}, ["a", "b"], "edit")
    b.keep_BL = keep
    assert b.counted_BL.tolist() == [[True, False, True, False, False, False, False, False],
                                     [True] * 4 + [False] * 4]
    assert FlowMatching(FlowSpec()).count(b) == 6.0          # 2 kept + 4: masked tokens are not counted
    v, eps = torch.randn(2, 8, 8), torch.randn(2, 8, 8)
    base = flow_loss(v, b.x0_BLC, eps, b.counted_BL)
    v2 = v.clone()
    v2[0, 1] += 100.0                                        # a masked target token's prediction: no effect
    v2[0, 3] -= 50.0
    assert torch.equal(flow_loss(v2, b.x0_BLC, eps, b.counted_BL), base)
    v2[0, 2] += 1.0                                          # a kept one moves it
    assert not torch.equal(flow_loss(v2, b.x0_BLC, eps, b.counted_BL), base)
    # rows(), to() carry the mask
    assert b.rows(slice(0, 1)).keep_BL.tolist() == keep[:1].tolist()
    assert b.to("cpu").keep_BL is not None
