"""The words of a caption, as the 'words' text encoder and the store's vocabulary count them. Torch-free, so
that data tasks (prepare's curation on Ray) use it without importing the model stack."""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z0-9]+")


def words_of(text: str) -> list[str]:
    return _WORD.findall(text.lower())
