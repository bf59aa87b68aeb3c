"""A tiny FLUX pipeline saved by diffusers, in the layout a FLUX.1 snapshot has (``model_index.json``, ``transformer/``,
``vae/``, ``text_encoder/`` + ``tokenizer/`` (CLIP), ``text_encoder_2/`` + ``tokenizer_2/`` (T5), ``scheduler/``): its
own configs and random weights (FLUX's latent layout: a 16-channel VAE of factor 8), built offline (the tokenizers are word-level ones made here, saved as transformers'
fast tokenizers). What a user points ``model.init_from`` at, at toy size."""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ("a an the in of on at to and with is red green blue yellow purple orange white black grey small large big "
         "circle square triangle top bottom left right centre center middle photo picture image cat dog emoji face "
         "smiling happy sad heart star sun moon tree house car").split()


def _tokenizer(max_length: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)


def save_tiny_flux_pipeline(root: str | Path, seed: int = 0, guidance_embeds: bool = True, hidden: int = 32,
                            heads: int = 2, double_blocks: int = 1, single_blocks: int = 1) -> Path:
    """Write the pipeline under ``root`` and return it. T5 width 32, CLIP width 24 (pooled 24), a 16-channel VAE of
    factor 8 with FLUX's scaling and shift factors, the transformer ``hidden`` wide."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    root = Path(root)
    torch.manual_seed(seed)
    n = 3 + len(WORDS)
    t5 = T5EncoderModel(T5Config(vocab_size=n, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                 pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=n, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=77, pad_token_id=0,
                                        bos_token_id=2, eos_token_id=1, projection_dim=24))
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 8, 16, 16),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=8, scaling_factor=0.3611, shift_factor=0.1159)
    head_dim = hidden // heads
    axes = (head_dim - 2 * (head_dim // 8 * 3), head_dim // 8 * 3, head_dim // 8 * 3)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=double_blocks,
                                         num_single_layers=single_blocks, attention_head_dim=head_dim,
                                         num_attention_heads=heads, joint_attention_dim=32, pooled_projection_dim=24,
                                         guidance_embeds=guidance_embeds, axes_dims_rope=axes)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=clip,
                        tokenizer=_tokenizer(77), text_encoder_2=t5, tokenizer_2=_tokenizer(512),
                        transformer=transformer)
    pipe.save_pretrained(root)
    return root


if __name__ == "__main__":
    import sys
    print(save_tiny_flux_pipeline(sys.argv[1]))
