"""A tiny FLUX pipeline saved by diffusers, in the layout a FLUX.1 snapshot has (``model_index.json``, ``transformer/``,
``vae/``, ``text_encoder/`` + ``tokenizer/`` (CLIP), ``text_encoder_2/`` + ``tokenizer_2/`` (T5), ``scheduler/``): its
own configs and random weights, FLUX's latent layout (a 16-channel VAE of factor 8), built offline: CLIP's BPE over
single bytes and T5 as ByT5 (bytes), so no vocabulary file is downloaded and any caption tokenizes. What a user points
``model.init_from`` at, at toy size (``tests/test_first_recipe.py``, ``tests/test_docs.py``)."""

from __future__ import annotations

from pathlib import Path


def byte_unicode() -> list[str]:
    """GPT-2/CLIP byte-to-unicode table: one printable character per byte value."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def save_tiny_flux_pipeline(root: str | Path, seed: int = 0, guidance_embeds: bool = True) -> Path:
    """Write the pipeline under ``root`` and return it: T5 and CLIP 32 wide (pooled 32), the transformer 32 wide with
    1 double and 1 single block, FLUX's VAE scaling and shift factors."""
    import torch
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    root = Path(root)
    torch.manual_seed(seed)
    chars = byte_unicode()   # CLIP's BPE over single bytes (alone and word-final): any caption tokenizes offline
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    clip_tok = transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=32, bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id)).eval()
    t5_tok = transformers.ByT5Tokenizer(extra_ids=0)   # bytes: no vocabulary file to download
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(t5_tok), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2)).eval()
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(4, 4, 4, 4), layers_per_block=1,
        latent_channels=16, norm_num_groups=2, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False).eval()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, out_channels=None, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6)).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
                 tokenizer_2=t5_tok, transformer=transformer).save_pretrained(root)
    return root


if __name__ == "__main__":
    import sys
    print(save_tiny_flux_pipeline(sys.argv[1]))
