import numpy as np
import pytest
import torch

from difftrain.data.batch import frames_of
from difftrain.shapes.world import ShapesWorld
from difftrain.shapes.loader import IndexStream, ShapesLoader, make_batch, pack_pixels, to_tensor
from difftrain.models.autoencoder import PixelUnshuffleAE
from difftrain.models.text import WordTextEncoder
from difftrain.shapes.captions import vocabulary

WORLD = ShapesWorld(seed=3, size=32, frames=3)
AE = PixelUnshuffleAE(4)
TOK = WordTextEncoder(vocabulary(), max_tokens=16, dim=16).tokenize
WEIGHTS = {"t2i": 0.5, "edit": 0.25, "keyframes": 0.25}


def loader(global_batch=4, rank=0, num_ranks=1, micro_batch=0, **kw):
    return ShapesLoader(WORLD, AE, TOK, global_batch, WEIGHTS, world_size=20, caption_dropout=0.2,
                        keyframe_cond_prob=0.5, seed=7, micro_batch=micro_batch, rank=rank, num_ranks=num_ranks, **kw)


def one(ld):
    """The single micro-batch of a step without accumulation."""
    (batch,) = next(ld)
    return batch


def test_index_stream_is_a_permutation_per_epoch_and_resumes():
    s = IndexStream(10, seed=1, task_id=0)
    first = s.take(10)
    assert sorted(first) == list(range(10))
    second = s.take(10)
    assert sorted(second) == list(range(10)) and second != first
    s2 = IndexStream(10, seed=1, task_id=0)
    s2.take(13)
    state = s2.state_dict()
    s3 = IndexStream(10, seed=1, task_id=0)
    s3.load_state_dict(state)
    assert s3.take(7) == s2.take(7)


def _same(a, b):
    return (a.task == b.task and a.prompts == b.prompts and torch.equal(a.x0_BLC, b.x0_BLC)
            and torch.equal(a.loss_mask_BL, b.loss_mask_BL) and torch.equal(a.ids_BL3, b.ids_BL3))


def test_loader_is_deterministic_and_mixes_tasks():
    a, b = loader(), loader()
    tasks = set()
    for _ in range(12):
        x, y = one(a), one(b)
        assert _same(x, y)
        tasks.add(x.task)
    assert tasks == {"t2i", "edit", "keyframes"}


def test_loader_resumes_exactly_from_its_state():
    a = loader()
    for _ in range(5):
        next(a)
    state = a.state_dict()
    expected = [one(a) for _ in range(6)]
    b = loader()
    b.load_state_dict(state)
    assert all(_same(x, one(b)) for x in expected)


def test_ranks_and_micro_batches_read_slices_of_the_same_global_batch():
    whole = loader(global_batch=4)
    parts = [loader(global_batch=4, rank=r, num_ranks=2) for r in range(2)]
    accum = loader(global_batch=4, micro_batch=1)          # 1 rank, 4 micro-batches of 1
    for step in range(12):                                 # caption dropout 0.2: some prompts are empty
        g = one(whole)
        p0, p1 = one(parts[0]), one(parts[1])
        micro = next(accum)
        assert len(micro) == 4
        assert p0.task == p1.task == g.task
        assert p0.prompts + p1.prompts == g.prompts == [p for b in micro for p in b.prompts]
        assert torch.equal(torch.cat([p0.x0_BLC, p1.x0_BLC]), g.x0_BLC)
        assert torch.equal(torch.cat([b.x0_BLC for b in micro]), g.x0_BLC)
        assert g.sample_ids == list(range(4 * step, 4 * step + 4)) == p0.sample_ids + p1.sample_ids
        # text is padded to the global batch's longest prompt, so a sample's tokens do not depend on the split
        ids = [b.tokens["ids"] for b in (g, p0, p1, *micro)]
        assert len({t.shape[1] for t in ids}) == 1
        assert torch.equal(torch.cat([b.tokens["ids"] for b in micro]), g.tokens["ids"])


class _Unshuffle(PixelUnshuffleAE):
    """The same autoencoder under another type: the loader encodes through it, not by packing the bytes."""


@pytest.mark.parametrize("factor,h,w", [(4, 32, 32), (8, 48, 48), (2, 8, 24), (8, 48, 96)])
def test_packing_the_bytes_is_the_unshuffle_and_patchify_bit_for_bit(factor, h, w):
    from difftrain.tokens import patchify
    images = np.random.default_rng(factor * h + w).integers(0, 256, (3, 2, h, w, 3), dtype=np.uint8)
    lat = PixelUnshuffleAE(factor).encode(to_tensor(images).flatten(0, 1))
    expected = patchify(lat).reshape(3, 2, -1, lat.shape[1] * 4)
    got = pack_pixels(images, factor)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="do not tile"):
        pack_pixels(images[:, :, : h - 1], factor)


@pytest.mark.parametrize("staged", [False, True])
def test_the_loaders_packed_batches_equal_the_encoded_ones(staged):
    """The loader packs the weightless autoencoder's tokens straight from the bytes and tokenizes a step's prompts
    once; every batch (each task, with caption dropout, on aspect canvases) equals the one built through
    ``encode``, micro-batch by micro-batch."""
    kw = {"stages": _wide_stages()} if staged else {}
    for mb in (0, 2):
        a = ShapesLoader(WORLD, AE, TOK, 4, WEIGHTS, world_size=20, caption_dropout=0.2, seed=7, micro_batch=mb, **kw)
        b = ShapesLoader(ShapesWorld(seed=3, size=32, frames=3), _Unshuffle(4), TOK, 4, WEIGHTS, world_size=20,
                         caption_dropout=0.2, seed=7, micro_batch=mb, **kw)
        tasks = set()
        for _ in range(12):
            for x, y in zip(next(a), next(b), strict=True):
                assert _same(x, y) and x.grid == y.grid and x.sample_ids == y.sample_ids
                assert x.tokens.keys() == y.tokens.keys()
                assert all(torch.equal(x.tokens[k], y.tokens[k]) for k in x.tokens)
                tasks.add(x.task)
        assert tasks == {"t2i", "edit", "keyframes"}


def _wide_stages():
    from difftrain.config.stages import Bucket, Stage
    return [Stage(0, "low", 0, (Bucket(32, 32, 4, patch=8), Bucket(32, 64, 4, patch=8), Bucket(64, 32, 4, patch=8)))]


def test_a_step_built_ahead_is_the_step_and_the_state_stays_that_of_the_steps_taken():
    """``prefetch`` builds the next step in a thread: the same batches as building it when asked; while it is pending
    (or built and not taken) the state is that of the steps taken, so a checkpoint then resumes at the right step;
    loading a state drops it; an error while building is raised where the step is taken."""
    plain, ahead = loader(), loader()
    for _ in range(8):
        before = ahead.state_dict()
        ahead.prefetch()
        ahead.prefetch()                       # a second call while one is pending changes nothing
        assert ahead.state_dict() == before
        assert _same(one(plain), one(ahead))
        assert ahead.state_dict() == plain.state_dict() != before
    ahead.prefetch()
    state = ahead.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert _same(one(resumed), one(plain))
    ahead.load_state_dict(before)              # the pending step is dropped, the loader goes back
    again = loader()
    again.load_state_dict(before)
    assert _same(one(ahead), one(again))

    class Broken(ShapesWorld):
        def t2i(self, index):
            raise RuntimeError(f"cannot render {index}")

    bad = ShapesLoader(Broken(seed=3, size=32, frames=3), AE, TOK, 4, {"t2i": 1.0}, world_size=20, seed=7)
    bad.prefetch()
    with pytest.raises(RuntimeError, match="cannot render"):
        next(bad)
    with pytest.raises(RuntimeError, match="cannot render"):      # and again, without a step built ahead
        next(bad)


def test_an_edits_changed_tokens_weigh_what_edit_changed_weight_says():
    """``edit_changed_weight``: an edit's target tokens with any pixel unlike the reference's weigh w in the loss and
    in its count, every other token 1 (a keyframe or t2i batch carries no weights); the objective divides by the sum."""
    from difftrain.diffusion.flow import FlowSpec, flow_loss, per_sample_error
    from difftrain.train.objectives import FlowMatching

    ld = ShapesLoader(ShapesWorld(seed=5, size=48, frames=3), PixelUnshuffleAE(8), TOK, 8,
                      {"edit": 1.0, "t2i": 1.0}, world_size=40, seed=2, edit_changed_weight=4.0)
    kinds, seen_edit = set(), False
    for _ in range(10):
        b = one(ld)
        if b.task != "edit":
            assert b.weight_BL is None
            continue
        seen_edit = True
        L = b.x0_BLC.shape[1] // 2
        changed = (b.x0_BLC[:, :L] != b.x0_BLC[:, L:]).any(-1)          # the tokens are the pixels, exactly
        assert changed.any(1).all()                                      # every edit changes something
        assert torch.equal(b.weight_BL[:, :L], torch.where(changed, 4.0, 1.0)) and (b.weight_BL[:, L:] == 1).all()
        kinds |= {m["spec"].kind for m in b.meta}
        counted = b.loss_mask_BL.float()
        assert FlowMatching(FlowSpec()).count(b) == float((counted * b.weight_BL).sum()) == L * len(b) + 3 * float(changed.sum())
        v, eps = torch.randn_like(b.x0_BLC), torch.randn_like(b.x0_BLC)
        err = (v - (eps - b.x0_BLC)).pow(2).mean(-1)
        expect = (err * counted * b.weight_BL).sum() / (counted * b.weight_BL).sum()
        assert torch.allclose(flow_loss(v, b.x0_BLC, eps, b.loss_weight_BL), expect)
        # per sample (DPO's replay term): each example's weighted mean
        w = counted * b.weight_BL
        assert torch.allclose(per_sample_error(v, b.x0_BLC, eps, b.loss_weight_BL), (err * w).sum(1) / w.sum(1))
        assert torch.equal(b.rows(slice(1, 3)).weight_BL, b.weight_BL[1:3]) and b.to("cpu").weight_BL is not None
    assert seen_edit and {"position", "color"} <= kinds
    plain = ShapesLoader(ShapesWorld(seed=5, size=48, frames=3), PixelUnshuffleAE(8), TOK, 8, {"edit": 1.0},
                         world_size=40, seed=2)
    assert one(plain).weight_BL is None


def test_resume_with_another_global_batch_is_refused():
    state = loader(global_batch=4).state_dict()
    with pytest.raises(ValueError, match="global batch"):
        loader(global_batch=2).load_state_dict(state)


def test_a_global_batch_the_ranks_do_not_divide_is_refused():
    with pytest.raises(ValueError, match="not divisible"):
        loader(global_batch=5, num_ranks=2)


def test_batches_follow_the_sequence_layout_of_each_task():
    tok = 4 * 4   # 32 px / factor 4 = 8 latent px -> 4x4 tokens per frame
    t2i = make_batch(WORLD, AE, TOK, "t2i", [0, 1])
    assert t2i.x0_BLC.shape == (2, tok, 48 * 4) and t2i.loss_mask_BL.all()
    assert (t2i.ids_BL3[..., 0] == 0).all()
    edit = make_batch(WORLD, AE, TOK, "edit", [0])
    assert edit.ids_BL3[0, :tok, 0].eq(0).all() and edit.ids_BL3[0, tok:, 0].eq(1).all()
    assert edit.loss_mask_BL[0, :tok].all() and not edit.loss_mask_BL[0, tok:].any()
    src, tgt, instruction, _ = WORLD.edit(0)
    lat = frames_of(edit.x0_BLC, edit.grid)
    assert torch.allclose(AE.decode(lat[:, 1]), torch.from_numpy(src).float().permute(2, 0, 1)[None] / 127.5 - 1)
    assert edit.prompts == [instruction]
    kf = make_batch(WORLD, AE, TOK, "keyframes", [2], keyframe_targets=[[False, True, False]])
    assert kf.ids_BL3[0, :, 0].tolist() == [0] * tok + [1] * tok + [2] * tok
    assert kf.loss_mask_BL[0].tolist() == [False] * tok + [True] * tok + [False] * tok


def test_caption_dropout_and_keyframe_conditioning_happen_at_their_rates():
    a = loader(global_batch=8)
    empty = total = cond = kf = 0
    for _ in range(60):
        b = one(a)
        empty += sum(p == "" for p in b.prompts)
        total += len(b)
        if b.task == "keyframes":
            per = b.loss_mask_BL.view(len(b), 3, -1)[..., 0]
            kf += len(b)
            cond += int((~per).any(1).sum())
            assert per.any(1).all()      # never everything given
    assert 0.1 < empty / total < 0.3
    assert 0.3 < cond / kf < 0.7


def test_world_prompts_match_the_rendered_examples():
    for i in range(20):
        assert WORLD.prompt("t2i", i) == WORLD.t2i(i)[1]
        assert WORLD.prompt("edit", i) == WORLD.edit(i)[2]
        assert WORLD.prompt("keyframes", i) == WORLD.keyframes(i)[1]


def test_the_loader_follows_the_curriculum_rendering_each_bucket_as_the_export_lays_it_out():
    """With data.stages, each step renders one bucket of the stage in force: scenes at the bucket's short side,
    centred on its canvas as the exported world places them for the store; square buckets are the world's own
    scenes. Resuming mid-run (across the stage switch) gives the same batches."""
    from difftrain.config.stages import Bucket, Stage
    from difftrain.shapes.export import widen

    low = (Bucket(32, 32, 4, patch=8), Bucket(32, 64, 4, patch=8), Bucket(64, 32, 4, patch=8))
    high = (Bucket(48, 48, 4, patch=8),)
    stages = [Stage(0, "low", 0, low), Stage(1, "high", 6, high)]
    ld = loader(stages=stages)
    grids, seen_wide = [], False
    for step in range(10):
        b = one(ld)
        grids.append(b.grid[1:])
        if step >= 6:
            assert b.grid[1:] == (12, 12)
        else:
            assert b.grid[1:] in {(8, 8), (8, 16), (16, 8)}
        if b.task == "t2i" and b.grid[1:] == (8, 16):       # the 32-pixel scene centred on a 32 x 64 canvas
            expect = torch.from_numpy(widen(WORLD.t2i(b.meta[0]["index"])[0], 64 / 32)).float() / 127.5 - 1
            got = AE.decode(frames_of(b.x0_BLC, b.grid)[0, :1])[0].permute(1, 2, 0)
            assert got.shape == (32, 64, 3) and torch.allclose(got, expect, atol=1e-5)
            seen_wide = True
    assert len(set(grids[:6])) >= 2 and seen_wide
    a = loader(stages=stages)
    for _ in range(4):
        next(a)
    b = loader(stages=stages)
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        assert _same(one(a), one(b))


def test_the_shapes_source_refuses_stages_it_cannot_follow():
    """The on-the-fly source takes train.global_batch and the task weights: a stage's other global batch, or a
    mixture of store sources, is one clear error naming the stage, the bucket and what would work."""
    from difftrain.config import load_config, preset_path
    from difftrain.errors import UserError
    from difftrain.sources import ConfiguredSource

    fly = ['data.source="shapes"']
    stages = ConfiguredSource(load_config(preset_path("shapes-store"), fly)).shapes_stages()
    assert [s.name for s in stages] == ["low", "high"] and stages[1].buckets[1].name == "48x80"
    assert ConfiguredSource(load_config(preset_path("shapes-tiny"), [])).shapes_stages() is None
    one = 'data.stages=[{name = "low", start_step = 0, buckets = [[48, 48]], global_batch = 64}]'
    with pytest.raises(UserError, match=r"'low'.*48x48: global_batch 64.*train.global_batch \(32\)"):
        ConfiguredSource(load_config(preset_path("shapes-store"), fly + [one])).shapes_stages()
    mix = ('data.stages=[{name = "low", start_step = 0, buckets = [[48, 48]], '
           'mixture = {shapes_t2i = 1.0}}]')
    with pytest.raises(UserError, match="mixture"):
        ConfiguredSource(load_config(preset_path("shapes-store"), fly + [mix])).shapes_stages()
