"""What each optional part of difftrain needs beyond the core install.

``pip install difftrain`` (``pip install -e .`` in a clone) installs what training, sampling, evaluation, the demo,
checkpoints and monitoring need (torch, numpy, pillow, safetensors, rich, fsspec, tensorboard, prometheus-client,
matplotlib). The rest comes in extras, each named by what it serves, and ``all`` installs every one:

- ``data``: the data path — ``difftrain prepare`` (Ray Data, Lance), curation (imagehash), the latent store
  (``data.source = "store"``), preference pairs and their Parquet files (pyarrow);
- ``hf``: pretrained weights and Hugging Face formats — T5/CLIP text encoders (transformers), the FLUX VAE and
  export to diffusers (diffusers), LoRA and LoKr adapters (peft);
- ``fp8``: FP8 training and FP8/MX/NVFP4 inference through torchao.

A command that reaches a module of an extra that is not installed ends with a message naming the module, the
extra and the pip command (exit 2), not a traceback.
"""

from __future__ import annotations

EXTRAS: dict[str, tuple[str, ...]] = {
    "data": ("pyarrow", "lance", "ray", "imagehash"),
    "hf": ("diffusers", "transformers", "peft", "huggingface_hub", "tokenizers"),
    "fp8": ("torchao",),
}


def extra_of(module: str | None) -> str | None:
    """The extra that installs ``module`` (a dotted name: its top-level package decides), or None."""
    root = (module or "").split(".")[0]
    for extra, modules in EXTRAS.items():
        if root in modules:
            return extra
    return None


def _installed(package: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def missing_extra_message(exc: ModuleNotFoundError, verb: str) -> str | None:
    """What to tell a user whose command ``verb`` stopped at a module of an extra they did not install (None when
    the missing module belongs to no extra: a broken install, reported as it is)."""
    extra = extra_of(exc.name)
    if extra is None:
        return None
    root = exc.name.split(".")[0]
    if exc.name != root and _installed(root):     # the package is there, a module of it is not: another version
        return (f"'difftrain {verb}' needs {exc.name}, which the installed {root} lacks: pip install "
                f"'difftrain[{extra}]' installs the versions difftrain pins")
    return (f"'difftrain {verb}' needs {root}, which comes with difftrain's '{extra}' extra: "
            f"pip install 'difftrain[{extra}]' (in a clone: pip install -e '.[{extra}]'; '.[all]' installs every "
            "extra)")
