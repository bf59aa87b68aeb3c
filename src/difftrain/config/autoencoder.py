"""What the configured autoencoder makes of an image, read without loading it: latent channels and the
spatial factor. The built-in pixel-unshuffle gives 3 x factor^2 channels; a diffusers ``AutoencoderKL``
folder (``autoencoder.path``, or a pipeline folder with ``vae/``) states both in its ``config.json``
(``latent_channels``; the factor is 2 ^ (number of ``block_out_channels`` - 1), as diffusers builds it)."""

from __future__ import annotations

import json
from pathlib import Path

from difftrain.errors import UserError


# FLUX's VAE, assumed only where the folder is not needed: checking or planning a config away from the weights.
PLANNING_GEOMETRY = (16, 8)


def autoencoder_geometry(ae, strict: bool = True) -> tuple[int, int]:
    """(latent channels, spatial factor) of ``[autoencoder]``. ``strict=False`` (config checks, the planner)
    assumes FLUX's VAE when a diffusers folder is not there; encoding and training read it or stop."""
    if ae.kind == "pixel-unshuffle":
        return 3 * ae.factor * ae.factor, ae.factor
    root = Path(ae.path)
    conf = root / "vae" / "config.json" if (root / "vae" / "config.json").is_file() else root / "config.json"
    try:
        d = json.loads(conf.read_text())
        return int(d["latent_channels"]), 2 ** (len(d["block_out_channels"]) - 1)
    except OSError:
        if not strict:
            return PLANNING_GEOMETRY
        raise UserError(f"autoencoder.path = {ae.path!r}: no config.json there (expected a diffusers "
                        "AutoencoderKL folder, or a pipeline folder with vae/)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{conf}: not an AutoencoderKL config (latent_channels and block_out_channels "
                        f"expected): {e}") from None
