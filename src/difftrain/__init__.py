"""difftrain: PyTorch-native training of diffusion transformers."""

__version__ = "0.1.0"
