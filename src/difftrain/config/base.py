"""A pretrained base read whole from its folder: when ``model.init_from`` is a diffusers FLUX transformer folder, the
model's widths, blocks, RoPE axes and guidance embedding come from its ``config.json``; when that folder sits in a
diffusers pipeline (``model_index.json`` beside it), the text encoders are the pipeline's (its root, where
``text_encoder_2/`` + ``tokenizer_2/`` and ``text_encoder/`` + ``tokenizer/`` live) and the autoencoder its ``vae/``,
whose scaling and shift are read from its config when the autoencoder is built.

What a preset says of these keys describes the model the preset was written for (FLUX.1-dev): the base's folder
replaces it. What the user says (their own config file, or ``--set``) must agree with the folder: a contradiction is
an error naming the key, both values and the file. Config-only work (``plan`` before the weights are downloaded)
keeps the preset's values when the folder is not there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from difftrain.errors import UserError

# model.<key> <- the field of the same name (model_keys_from_diffusers_config)
MODEL_KEYS = ("in_channels", "text_dim", "pooled_dim", "hidden", "heads", "double_blocks", "single_blocks",
              "axes_dims_rope", "guidance_embed", "mlp_ratio", "qkv_bias", "rope_theta", "positions", "abs_pos_embed")
DERIVED_WHEN_ZERO = ("in_channels", "text_dim", "pooled_dim")     # 0: 'take it from the encoders', never a contradiction


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable JSON config ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def model_keys_from_diffusers_config(config: dict[str, Any]) -> dict[str, Any]:
    """``[model]`` keys (DiTParams' fields) of a diffusers ``FluxTransformer2DModel`` config (its ``config.json``);
    what diffusers' FLUX fixes (MLP ratio 4, q/k/v bias, RoPE theta 10000, positions from the corner, no absolute
    position embedding) as such. Raises ValueError / KeyError / TypeError for a config FLUX's layout cannot be."""
    if config.get("patch_size", 1) != 1:
        raise ValueError(f"patch_size {config['patch_size']} is not supported: FLUX packs 2x2 patches "
                         "outside the transformer (patch_size 1)")
    out = config.get("out_channels") or config["in_channels"]
    if out != config["in_channels"]:
        raise ValueError(f"out_channels {out} != in_channels {config['in_channels']} is not supported")
    heads, head_dim = int(config["num_attention_heads"]), int(config["attention_head_dim"])
    return {"in_channels": int(config["in_channels"]), "text_dim": int(config["joint_attention_dim"]),
            "pooled_dim": int(config["pooled_projection_dim"]), "hidden": heads * head_dim, "heads": heads,
            "double_blocks": int(config["num_layers"]), "single_blocks": int(config["num_single_layers"]),
            "mlp_ratio": 4.0, "axes_dims_rope": [int(a) for a in config["axes_dims_rope"]], "rope_theta": 10000.0,
            "guidance_embed": bool(config.get("guidance_embeds", False)), "qkv_bias": True, "positions": "corner",
            "abs_pos_embed": False}


def transformer_folder(init_from: str) -> tuple[Path, dict[str, Any]] | None:
    """The diffusers FLUX transformer folder ``init_from`` names and its config (None: not one, or not there)."""
    if not init_from:
        return None
    p = Path(init_from)
    config = p / "config.json"
    if not p.is_dir() or not config.is_file():
        return None
    data = _json(config)
    flux = data.get("_class_name", "FluxTransformer2DModel") == "FluxTransformer2DModel" and "num_attention_heads" in data
    return (p, data) if flux else None


def pipeline_root(transformer: Path) -> Path | None:
    root = transformer.parent
    return root if (root / "model_index.json").is_file() else None


def resolve_base(cfg, user_keys: set[str], source: str) -> None:
    """Fill the config's model, text and autoencoder keys from ``model.init_from``'s folder (in place)."""
    found = transformer_folder(cfg.model.init_from)
    if found is None:
        return
    folder, config = found
    config_path = folder / "config.json"
    try:
        theirs = model_keys_from_diffusers_config(config)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"model.init_from = {cfg.model.init_from!r}: {config_path} is not a FLUX transformer config "
                        f"this model can take ({type(e).__name__}: {e})") from None
    m = cfg.model
    for key in MODEL_KEYS:
        value = theirs[key]
        mine = getattr(m, key)
        if f"model.{key}" in user_keys and mine != value and not (key in DERIVED_WHEN_ZERO and mine == 0):
            raise UserError(f"{source}: model.{key} = {mine!r} contradicts the base: {config_path} gives {value!r} "
                            f"(leave model.{key} out to take the base's)")
        setattr(m, key, value)
    root = pipeline_root(folder)
    if root is None:
        return
    t = cfg.text
    if t.kind == "hf":
        for key, sub in (("t5_path", "text_encoder_2"), ("clip_path", "text_encoder")):
            if f"text.{key}" not in user_keys and (root / sub / "config.json").is_file():
                setattr(t, key, str(root))       # the pipeline root: its tokenizer folders are read from there
    ae = cfg.autoencoder
    vae = root / "vae" / "config.json"
    if ae.kind == "diffusers" and vae.is_file():
        if "autoencoder.path" not in user_keys:
            ae.path = str(root / "vae")
        if Path(ae.path).resolve() == (root / "vae").resolve():
            data = _json(vae)
            for key, field in (("scaling", "scaling_factor"), ("shift", "shift_factor")):
                given, stated = getattr(ae, key), data.get(field)
                if f"autoencoder.{key}" in user_keys and given and stated is not None and float(stated) != given:
                    raise UserError(f"{source}: autoencoder.{key} = {given!r} contradicts the base: {vae} gives "
                                    f"{field} = {stated!r} (leave autoencoder.{key} out to take the VAE's)")
