"""Other packages' notices at import, kept off a command's output unless asked for (``-v`` / ``--debug``).

A plain ``difftrain`` command printed some seven lines before its own: torchao's compiled kernels for other GPUs
that a CPU build cannot load, "no triton", torch's pytree deprecations that torchao triggers, diffusers' and
transformers' notices and their weight-loading progress bars. None of them is about the user's run: where a missing
kernel matters (an fp8 or nf4 path), difftrain says so itself, in one line naming the key. Set through the
packages' own switches (their loggers' levels and their documented environment variables), before they are
imported.
"""

from __future__ import annotations

import logging
import os

LOGGERS = ("torchao", "torch.utils._pytree", "diffusers", "transformers", "huggingface_hub")
ENV = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
       "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


def quiet_third_party(verbose: bool = False) -> None:
    """Silence other packages' import-time notices (``verbose``: leave everything as the packages set it)."""
    if verbose:
        return
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
