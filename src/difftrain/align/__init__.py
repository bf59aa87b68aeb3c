"""Aligning a model with human preference: candidates, preference pairs, the round loop."""
