"""Frozen text encoders (HFTextEncoder) and autoencoders, against tiny random models saved to disk and
loaded back through the real loading code (no mocks, no hub access)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from difftrain.errors import UserError
from difftrain.models.autoencoder import DiffusersAE, PixelUnshuffleAE, build_autoencoder
from difftrain.models.hf_text import HFTextEncoder
from difftrain.models.text import PromptTooLong

from tiny_flux import byte_unicode

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

PROMPTS = ["a red cube left of a blue ball", "hi"]
MAX = 40


def _tiny_clip_tokenizer():
    """A real CLIP BPE tokenizer over a tiny vocabulary: every byte (alone and word-final) plus two
    merges, so any prompt tokenizes (mostly to single bytes) with no download."""
    chars = byte_unicode()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    merges = [("r", "e"), ("re", "d</w>")]
    for m in merges:
        vocab["".join(m)] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return transformers.CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny T5 encoder + ByT5 byte tokenizer and tiny CLIP text model + BPE tokenizer, saved to disk.
    Returns the folders and the in-memory originals (the reference for what loading must give)."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("encoders")
    t5_tok = transformers.ByT5Tokenizer()
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)).eval()
    clip_tok = _tiny_clip_tokenizer()
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=32,
        bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
        pad_token_id=clip_tok.pad_token_id)).eval()
    t5_dir, clip_dir = root / "t5", root / "clip"
    for model, tok, d in ((t5, t5_tok, t5_dir), (clip, clip_tok, clip_dir)):
        model.save_pretrained(d)
        tok.save_pretrained(d)
    return {"t5": str(t5_dir), "clip": str(clip_dir), "t5_model": t5, "clip_model": clip,
            "t5_tok": t5_tok, "clip_tok": clip_tok, "root": root}


def _check_frozen(enc: HFTextEncoder, emb) -> None:
    assert enc.trainable is False
    params = list(enc.parameters())
    assert params and not any(p.requires_grad for p in params)
    enc.train()  # a parent's .train() must leave the frozen encoders in eval mode
    assert not any(m.training for m in enc.modules())
    for t in (emb.txt_BTD, emb.pooled_BP):
        assert t.dtype == torch.float32 and not t.requires_grad and t.grad_fn is None
    assert emb.mask_BT.dtype == torch.bool


@pytest.mark.filterwarnings("error::difftrain.models.text.PromptTooLong")
def test_t5_and_clip_match_direct_transformers_calls(tiny):
    """text.padding = 'padded', as FLUX: full-length padding, T5 run over it unmasked."""
    enc = HFTextEncoder.from_paths(tiny["t5"], tiny["clip"], max_tokens=MAX, dtype="fp32", padding="padded")
    assert (enc.dim, enc.pooled_dim, enc.max_tokens) == (32, 32, MAX)
    tokens = enc.tokenize(PROMPTS)
    emb = enc(tokens)
    assert emb.txt_BTD.shape == (2, MAX, 32) and emb.pooled_BP.shape == (2, 32)
    assert emb.mask_BT.shape == (2, MAX)
    _check_frozen(enc, emb)

    # Token ids are exactly what the tokenizers give, padded to full length (T5: MAX, CLIP: 77).
    ref_t5 = tiny["t5_tok"](PROMPTS, padding="max_length", max_length=MAX, return_tensors="pt")
    ref_clip = tiny["clip_tok"](PROMPTS, padding="max_length", max_length=77, return_tensors="pt")
    assert torch.equal(tokens["t5_ids"], ref_t5["input_ids"])
    assert torch.equal(tokens["clip_ids"], ref_clip["input_ids"])
    # Every position is attended under 'padded' (the padding states included, as FLUX was trained).
    assert bool(emb.mask_BT.all())

    with torch.no_grad():
        want_txt = tiny["t5_model"](input_ids=ref_t5["input_ids"]).last_hidden_state
        want_pooled = tiny["clip_model"](input_ids=ref_clip["input_ids"]).pooler_output
    assert (emb.txt_BTD - want_txt).abs().max() <= 1e-5
    assert (emb.pooled_BP - want_pooled).abs().max() <= 1e-5
    # The two prompts give different embeddings (the weights are not degenerate).
    assert (emb.pooled_BP[0] - emb.pooled_BP[1]).abs().max() > 1e-3


@pytest.mark.filterwarnings("error::difftrain.models.text.PromptTooLong")
def test_masked_rule_states_do_not_depend_on_padding(tiny):
    """text.padding = 'masked': T5 runs with its attention mask, text is padded to a rung of the ladder, and a
    caption's states are the same whatever it is padded to (alone, beside a long caption, to max_tokens)."""
    enc = HFTextEncoder.from_paths(tiny["t5"], tiny["clip"], max_tokens=MAX, dtype="fp32", padding="masked")
    tokens = enc.tokenize(PROMPTS)
    assert tokens["t5_ids"].shape[1] == 32                # the longest is 31 bytes + </s>: rung 32 of 8..MAX
    assert tokens["clip_ids"].shape[1] == 77              # CLIP only pools here: its own full length, as FLUX
    emb = enc(tokens)
    assert emb.mask_BT[1].tolist() == [True] * 3 + [False] * 29     # "hi": 2 bytes + </s>
    alone = enc(enc.tokenize(PROMPTS[1:]))
    assert alone.txt_BTD.shape[1] == 8
    full = enc(enc.tokenize(PROMPTS[1:], length=MAX))
    for other in (emb.txt_BTD[1:], full.txt_BTD):
        assert (other[0, :3] - alone.txt_BTD[0, :3]).abs().max() <= 1e-5
    with torch.no_grad():
        ref = tiny["t5_tok"](PROMPTS[1:], return_tensors="pt")
        want = tiny["t5_model"](input_ids=ref["input_ids"]).last_hidden_state   # no padding at all
    assert (alone.txt_BTD[0, :3] - want[0]).abs().max() <= 1e-5
    assert torch.allclose(alone.pooled_BP, emb.pooled_BP[1:], atol=1e-5)
    # Unmasked ('padded') states of the same caption differ: the rule matters.
    padded = HFTextEncoder.from_paths(tiny["t5"], tiny["clip"], max_tokens=MAX, dtype="fp32", padding="padded")
    assert (padded(padded.tokenize(PROMPTS[1:])).txt_BTD[0, :3] - want[0]).abs().max() > 1e-4


def test_t5_only_pools_by_masked_mean(tiny):
    enc = HFTextEncoder.from_paths(tiny["t5"], "", max_tokens=MAX, dtype="fp32", padding="padded")
    assert enc.clip is None and enc.pooled_dim == 32
    tokens = enc.tokenize(PROMPTS)
    assert set(tokens) == {"t5_ids", "t5_mask"}
    emb = enc(tokens)
    assert emb.txt_BTD.shape == (2, MAX, 32) and emb.pooled_BP.shape == (2, 32)
    _check_frozen(enc, emb)
    with torch.no_grad():
        want = tiny["t5_model"](input_ids=tokens["t5_ids"]).last_hidden_state
    assert (emb.txt_BTD - want).abs().max() <= 1e-5
    n = int(tokens["t5_mask"][1].sum())
    assert n == 3
    assert torch.allclose(emb.pooled_BP[1], want[1, :n].mean(0), atol=1e-5)
    assert not torch.allclose(emb.pooled_BP[1], want[1].mean(0), atol=1e-4)  # padding excluded


@pytest.mark.filterwarnings("error::difftrain.models.text.PromptTooLong")
def test_clip_only_gives_sequence_and_pooled(tiny):
    enc = HFTextEncoder.from_paths("", tiny["clip"], max_tokens=30, dtype="fp32", padding="padded")
    assert enc.t5 is None and (enc.dim, enc.pooled_dim, enc.max_tokens) == (32, 32, 30)
    tokens = enc.tokenize(PROMPTS)
    assert set(tokens) == {"clip_ids", "clip_mask"}
    emb = enc(tokens)
    assert emb.txt_BTD.shape == (2, 30, 32) and emb.pooled_BP.shape == (2, 32)
    _check_frozen(enc, emb)
    with torch.no_grad():
        out = tiny["clip_model"](input_ids=tokens["clip_ids"])
    assert (emb.txt_BTD - out.last_hidden_state).abs().max() <= 1e-5
    assert (emb.pooled_BP - out.pooler_output).abs().max() <= 1e-5
    assert tokens["clip_mask"][1].sum() == 4 and bool(emb.mask_BT.all())   # <sot> h i <eot>; all attended
    # CLIP has only 77 positions: a longer max_tokens is capped, not an index error.
    assert HFTextEncoder.from_paths("", tiny["clip"], max_tokens=512, dtype="fp32").max_tokens == 77


def test_long_prompt_warns_and_is_truncated(tiny):
    enc = HFTextEncoder.from_paths(tiny["t5"], tiny["clip"], max_tokens=MAX, dtype="fp32")
    long = "x" * 60  # 61 ByT5 tokens > MAX; 62 CLIP tokens < 77
    with pytest.warns(PromptTooLong, match=f"has 61 tokens; truncated to the encoder's limit of {MAX}"):
        tokens = enc.tokenize([long, "hi"])
    assert tokens["t5_ids"].shape == (2, MAX)
    assert tokens["t5_ids"][0, -1] == tiny["t5_tok"].eos_token_id  # truncated content, EOS kept
    assert bool(tokens["t5_mask"][0].all())
    emb = enc(tokens)
    assert emb.txt_BTD.shape == (2, MAX, 32)
    with pytest.warns(PromptTooLong) as record:  # CLIP's own limit (77) is checked too
        enc.tokenize(["y " * 100])  # 201 ByT5 tokens, 102 CLIP tokens
    assert sorted(str(w.message).split("has ")[1] for w in record) == [
        "102 tokens; truncated to the encoder's limit of 77", f"201 tokens; truncated to the encoder's limit of {MAX}"]


def test_bf16_compute_gives_float32_outputs(tiny):
    ref = HFTextEncoder.from_paths(tiny["t5"], tiny["clip"], max_tokens=MAX, dtype="fp32")
    enc = HFTextEncoder.from_paths(tiny["t5"], tiny["clip"], max_tokens=MAX, dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in enc.parameters())
    emb, want = enc(enc.tokenize(PROMPTS)), ref(ref.tokenize(PROMPTS))
    assert emb.txt_BTD.dtype == torch.float32 and emb.pooled_BP.dtype == torch.float32
    assert (emb.txt_BTD - want.txt_BTD).abs().max() < 0.1
    if not torch.cuda.is_available():  # 'auto' never picks bf16 on a CPU (slow there)
        auto = HFTextEncoder.from_paths(tiny["t5"], "", max_tokens=MAX, dtype="auto")
        assert all(p.dtype == torch.float32 for p in auto.parameters())


def test_flux_pipeline_folder_layout(tiny):
    pipe = tiny["root"] / "pipeline"
    for src, model_sub, tok_sub in ((tiny["t5"], "text_encoder_2", "tokenizer_2"),
                                    (tiny["clip"], "text_encoder", "tokenizer")):
        shutil.copytree(src, pipe / model_sub, dirs_exist_ok=True)
        shutil.copytree(src, pipe / tok_sub, dirs_exist_ok=True)
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    enc = HFTextEncoder.from_paths(str(pipe), str(pipe), max_tokens=MAX, dtype="fp32")
    ref = HFTextEncoder.from_paths(tiny["t5"], tiny["clip"], max_tokens=MAX, dtype="fp32")
    emb, want = enc(enc.tokenize(PROMPTS)), ref(ref.tokenize(PROMPTS))
    assert torch.equal(emb.txt_BTD, want.txt_BTD) and torch.equal(emb.pooled_BP, want.pooled_BP)


def test_bad_paths_raise_user_errors(tiny, tmp_path):
    missing = str(tmp_path / "nowhere")
    cases = [((missing, ""), "text.t5_path", missing),
             (("", missing), "text.clip_path", missing),
             ((tiny["t5"], tiny["t5"]), "text.clip_path", tiny["t5"]),  # a T5 folder given as CLIP
             ((tiny["clip"], ""), "text.t5_path", tiny["clip"])]
    no_weights = tmp_path / "no_weights"  # config.json but no weights or tokenizer
    no_weights.mkdir()
    shutil.copy(f"{tiny['t5']}/config.json", no_weights / "config.json")
    cases.append(((str(no_weights), ""), "text.t5_path", str(no_weights)))
    for (t5_path, clip_path), key, path in cases:
        with pytest.raises(UserError) as info:
            HFTextEncoder.from_paths(t5_path, clip_path, max_tokens=MAX, dtype="fp32")
        msg = str(info.value)
        assert key in msg and path in msg and "expected" in msg and "\n" not in msg, msg
    with pytest.raises(UserError, match="t5_path and/or text.clip_path"):
        HFTextEncoder.from_paths("", "", max_tokens=MAX)
    with pytest.raises(UserError, match="text.dtype"):
        HFTextEncoder.from_paths(tiny["t5"], "", max_tokens=MAX, dtype="fp16")


# --- autoencoders --------------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [2, 4])
def test_pixel_unshuffle_round_trip(factor):
    ae = PixelUnshuffleAE(factor)
    x = torch.rand(2, 3, 16, 8) * 2 - 1
    z = ae.encode(x)
    assert z.shape == (2, 3 * factor * factor, 16 // factor, 8 // factor)
    assert ae.latent_channels == 3 * factor * factor
    assert torch.equal(ae.decode(z), x)
    assert torch.equal(z[:, :, 0, 0].reshape(2, 3, factor, factor), x[:, :, :factor, :factor])


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=16, scaling_factor=0.5,
        shift_factor=0.1).eval()
    path = tmp_path_factory.mktemp("vae") / "vae"
    vae.save_pretrained(path)
    return vae, str(path)


def test_diffusers_ae_matches_direct_vae(tiny_vae):
    vae, path = tiny_vae
    ae = DiffusersAE.from_path(path)
    assert (ae.factor, ae.latent_channels, ae.scaling, ae.shift) == (2, 4, 0.5, pytest.approx(0.1))
    assert not any(p.requires_grad for p in ae.parameters())
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    z = ae.encode(x)
    assert z.shape == (2, 4, 8, 8) and z.dtype == torch.float32
    with torch.no_grad():
        want = (vae.encode(x).latent_dist.mode() - 0.1) * 0.5
        lat = torch.randn(2, 4, 8, 8)
        want_img = vae.decode(lat / 0.5 + 0.1).sample.clamp(-1, 1)
    assert (z - want).abs().max() <= 1e-5
    assert (ae.decode(lat) - want_img).abs().max() <= 1e-5
    assert not torch.allclose(vae.decode(lat).sample.clamp(-1, 1), want_img, atol=1e-3)  # normalisation matters
    # Explicit values override the config's; build_autoencoder takes the config's when given 0.
    ae2 = DiffusersAE.from_path(path, scaling=2.0, shift=-0.3)
    assert (ae2.scaling, ae2.shift) == (2.0, -0.3)
    with torch.no_grad():
        assert (ae2.encode(x) - (vae.encode(x).latent_dist.mode() + 0.3) * 2.0).abs().max() <= 1e-5
    ae3 = build_autoencoder("diffusers", path=path)
    assert (ae3.scaling, ae3.shift) == (0.5, pytest.approx(0.1))


def test_diffusers_ae_pipeline_folder_and_errors(tiny_vae, tmp_path):
    _, path = tiny_vae
    pipe = tmp_path / "pipe"
    shutil.copytree(path, pipe / "vae")
    assert DiffusersAE.from_path(str(pipe)).latent_channels == 4
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(f"{path}/config.json", no_weights / "config.json")
    for bad in (str(empty), str(tmp_path / "missing"), str(no_weights)):
        with pytest.raises(UserError) as info:
            build_autoencoder("diffusers", path=bad)
        assert "autoencoder.path" in str(info.value) and bad in str(info.value)


def test_training_and_sampling_with_frozen_hf_encoders_and_vae(tiny, tiny_vae, tiny_cfg, tmp_path):
    """The real-component path end to end: T5 + CLIP text, AutoencoderKL latents, a few steps, a
    checkpoint, then sampling from it. The frozen parts must stay untouched and out of the checkpoint."""
    from difftrain.inference import load_pipeline, request_batch
    from difftrain.train import build_trainer

    cfg = tiny_cfg("text.kind=hf", f"text.t5_path={tiny['t5']}", f"text.clip_path={tiny['clip']}",
                   "text.max_tokens=96", "autoencoder.kind=diffusers", f"autoencoder.path={tiny_vae[1]}",
                   "train.steps=3", "train.checkpoint_every=0")
    tr = build_trainer(cfg, tmp_path / "run")
    assert set(tr.model.keys()) == {"dit"}
    assert tr.dit.params.in_channels == 16 and tr.dit.params.text_dim == 32 and tr.dit.params.pooled_dim == 32
    frozen = {k: v.clone() for k, v in tr.text_encoder.state_dict().items()}
    summary = tr.fit()
    assert summary["steps"] == 3
    assert all(torch.equal(frozen[k], v) for k, v in tr.text_encoder.state_dict().items())
    pipe, cfg2, info = load_pipeline(tmp_path / "run")
    batch = request_batch(pipe, cfg2, ["a small red circle in the top left"])
    imgs = pipe.to_images(pipe.sample(batch, steps=2, cfg_scale=2.0, seed=1))
    assert imgs.shape == (1, 1, 32, 32, 3) and imgs.dtype.name == "uint8"


def test_bucket_geometry_and_store_channels_come_from_the_autoencoders_own_config(tiny_vae, tmp_path, tiny_cfg):
    """Channels and spatial factor of a diffusers autoencoder are read from its config.json (a pipeline
    folder's vae/ included), as the loaded model sees them; no folder: a clear error where latents are made,
    FLUX's VAE assumed where a config is only checked or planned."""
    import shutil

    from difftrain.config.autoencoder import PLANNING_GEOMETRY, autoencoder_geometry
    from difftrain.config.stages import patch_pixels
    from difftrain.errors import UserError
    from difftrain.models.autoencoder import DiffusersAE

    _, vae_path = tiny_vae
    pipeline = tmp_path / "pipeline"
    shutil.copytree(vae_path, pipeline / "vae")
    for path in (vae_path, str(pipeline)):
        cfg = tiny_cfg("autoencoder.kind=diffusers", f"autoencoder.path={path}")
        ae = DiffusersAE.from_path(path)
        assert autoencoder_geometry(cfg.autoencoder) == (ae.latent_channels, ae.factor)
        assert patch_pixels(cfg, strict=True) == 2 * ae.factor
    assert (ae.latent_channels, ae.factor) != PLANNING_GEOMETRY      # the old defaults would have been wrong
    missing = tiny_cfg("autoencoder.kind=diffusers", f"autoencoder.path={tmp_path / 'nowhere'}")
    with pytest.raises(UserError, match="autoencoder.path = .*nowhere.*no config.json"):
        autoencoder_geometry(missing.autoencoder)
    assert autoencoder_geometry(missing.autoencoder, strict=False) == PLANNING_GEOMETRY
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"latent_channels": 4}')
    with pytest.raises(UserError, match="bad/config.json: not an AutoencoderKL config"):
        autoencoder_geometry(tiny_cfg("autoencoder.kind=diffusers", f"autoencoder.path={bad}").autoencoder)


@pytest.mark.filterwarnings("error::difftrain.models.text.PromptTooLong")
def test_the_flux_preset_gives_diffusers_text_tensors(tiny):
    """The flux-dev preset's text rule ('padded', 512 tokens) built from its config gives, for the same prompts,
    the tensors diffusers' FluxPipeline.encode_prompt gives FLUX.1-dev (tiny T5 and CLIP stand in)."""
    diffusers = pytest.importorskip("diffusers")
    from difftrain.config import load_config, preset_path
    from difftrain.models import build_text_encoder

    cfg = load_config(preset_path("flux-dev"), [f"text.t5_path={tiny['t5']}", f"text.clip_path={tiny['clip']}",
                                                "text.dtype=fp32"])
    assert (cfg.text.padding, cfg.text.max_tokens, cfg.sample.guidance) == ("padded", 512, 3.5)
    enc = build_text_encoder(cfg)
    emb = enc(enc.tokenize(PROMPTS))
    pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=None,
                                  text_encoder=tiny["clip_model"], tokenizer=tiny["clip_tok"],
                                  text_encoder_2=tiny["t5_model"], tokenizer_2=tiny["t5_tok"], transformer=None)
    with torch.no_grad():
        txt, pooled, _ = pipe.encode_prompt(prompt=PROMPTS, prompt_2=PROMPTS, device="cpu",
                                            max_sequence_length=cfg.text.max_tokens)
    assert emb.txt_BTD.shape == txt.shape == (len(PROMPTS), 512, 32)
    assert (emb.txt_BTD - txt).abs().max() <= 1e-5 and (emb.pooled_BP - pooled).abs().max() <= 1e-5
    assert bool(emb.mask_BT.all())                         # every position attended, as FLUX's DiT sees them


@pytest.mark.parametrize("which", ["both", "clip"])
def test_lazy_encoders_know_their_widths_without_weights_and_build_on_first_use(tiny, which):
    """``LazyHFTextEncoder`` (what a trainer holds): widths, text rule and checkpoint record come from config.json
    alone; the weights are read the first time something tokenizes or encodes, and then give exactly what the
    eager encoder gives; ``release`` drops them and the next use builds them again."""
    from difftrain.models.hf_text import LazyHFTextEncoder, resident_bytes

    t5 = tiny["t5"] if which == "both" else ""
    eager = HFTextEncoder.from_paths(t5, tiny["clip"], max_tokens=MAX, dtype="fp32", padding="masked")
    built = []
    lazy = LazyHFTextEncoder(t5, tiny["clip"], MAX, "fp32", "cpu", "masked", on_build=built.append)
    assert not lazy.built and not built and list(lazy.parameters()) == []
    assert (lazy.dim, lazy.pooled_dim, lazy.max_tokens, lazy.trainable) == (eager.dim, eager.pooled_dim,
                                                                            eager.max_tokens, False)
    assert lazy.extra_state() == eager.extra_state()
    assert not lazy.built                                  # none of the above read a weight
    tokens = lazy.tokenize(PROMPTS)
    assert lazy.built and len(built) == 1 and built[0] is lazy.encoder()
    for k, v in eager.tokenize(PROMPTS).items():
        assert torch.equal(tokens[k], v)
    got, want = lazy(tokens), eager(tokens)
    assert torch.equal(got.txt_BTD, want.txt_BTD) and torch.equal(got.pooled_BP, want.pooled_BP)
    assert resident_bytes(lazy.encoder()) == sum(p.numel() * 4 for p in eager.parameters()) + sum(
        b.numel() * b.element_size() for b in eager.buffers())
    lazy.release()
    assert not lazy.built and lazy.dim == eager.dim
    assert torch.equal(lazy(tokens).pooled_BP, want.pooled_BP) and len(built) == 2


def test_lazy_encoders_refuse_a_wrong_folder_at_construction(tiny, tmp_path):
    """A wrong path fails when the run starts (config.json is read then), not at the first preview hours later."""
    from difftrain.models.hf_text import LazyHFTextEncoder

    with pytest.raises(UserError, match=r"text.t5_path = .*no config.json there"):
        LazyHFTextEncoder(str(tmp_path), "", MAX)
    with pytest.raises(UserError, match=r"text.t5_path = .*holds a 'clip_text_model' model"):
        LazyHFTextEncoder(tiny["clip"], "", MAX)
