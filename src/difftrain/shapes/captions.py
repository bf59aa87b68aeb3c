"""The shapes world's text: every caption and instruction it can produce (its word vocabulary), and
parsing them back into the attributes they name (the evaluator reads prompts this way; ``sample --edit``
builds an edit from an instruction)."""

from __future__ import annotations

import re
from dataclasses import replace
from functools import lru_cache
from typing import Any

from difftrain.shapes.world import (
    ALL_COLORS, COLORS, POSITIONS, SHAPES, SIZES, EditSpec, MotionSpec, ShapeSpec, apply_edit, instruction_for,
)


@lru_cache(maxsize=1)
def _all_texts() -> tuple[str, ...]:
    """Every caption and instruction the world can produce (~3k strings), built with the
    same functions the sampler uses, so the vocabulary cannot drift from the captions."""
    texts: list[str] = []
    for shape in SHAPES:
        for color in COLORS:
            for size in SIZES:
                for cell in POSITIONS.values():
                    spec = ShapeSpec(shape, color, *cell, size)
                    texts.append(spec.caption())
                    texts.append(instruction_for("size", spec, spec))
                    texts.append(instruction_for("color", spec, spec))
                    texts += [instruction_for("shape", spec, replace(spec, shape=other)) for other in SHAPES]
                    for end in POSITIONS.values():
                        if end != cell:
                            texts.append(MotionSpec(shape, color, size, cell, end).caption())
                            texts.append(instruction_for("position", spec, replace(spec, row=end[0], col=end[1])))
    return tuple(texts)


def vocabulary() -> list[str]:
    """Sorted list of every word that any caption or instruction can contain."""
    return sorted({word for text in _all_texts() for word in text.split(" ")})


def _normalise(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".").split())


_ALT = lambda names: "|".join(sorted(names, key=len, reverse=True))  # noqa: E731 (longest first)
_SHAPE, _COLOR, _SIZE, _POS = f"({_ALT(SHAPES)})", f"({_ALT(ALL_COLORS)})", f"({_ALT(SIZES)})", f"({_ALT(POSITIONS)})"
_CAPTION_RE = re.compile(rf"an? {_SIZE} {_COLOR} {_SHAPE} in the {_POS}")
_MOTION_RE = re.compile(rf"an? {_SIZE} {_COLOR} {_SHAPE} moving from the {_POS} to the {_POS}")
_COLOR_EDIT_RE = re.compile(rf"make the {_SHAPE} {_COLOR}")
_MOVE_EDIT_RE = re.compile(rf"move it to the {_POS}")
_SHAPE_EDIT_RE = re.compile(rf"turn the {_SHAPE} into an? {_SHAPE}")
_SIZE_EDIT_RE = re.compile(rf"make it {_SIZE}")


def parse_caption(text: str) -> dict[str, Any]:
    """'a small red circle in the top left' -> {shape, color, size, row, col}."""
    m = _CAPTION_RE.fullmatch(_normalise(text))
    if m is None:
        raise ValueError(f"cannot parse shapes caption {text!r}")
    size, color, shape, pos = m.groups()
    row, col = POSITIONS[pos]
    return {"shape": shape, "color": color, "size": size, "row": row, "col": col}


def parse_motion(text: str) -> dict[str, Any]:
    """'a small red circle moving from the top left to the center' -> {shape, color, size, start, end}."""
    m = _MOTION_RE.fullmatch(_normalise(text))
    if m is None:
        raise ValueError(f"cannot parse shapes motion caption {text!r}")
    size, color, shape, start, end = m.groups()
    if start == end:
        raise ValueError(f"motion caption {text!r} starts and ends in the same cell")
    return {"shape": shape, "color": color, "size": size, "start": POSITIONS[start], "end": POSITIONS[end]}


def _as_attributes(spec: ShapeSpec | dict[str, Any]) -> dict[str, Any]:
    if isinstance(spec, ShapeSpec):
        return spec.attributes()
    return {k: spec[k] for k in ("shape", "color", "size", "row", "col")}


def parse_instruction_kind(text: str, source: ShapeSpec | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Parse an edit instruction against its source scene; returns (kind, target attributes)."""
    clean = _normalise(text)
    target = _as_attributes(source)
    named = None  # the shape the instruction refers to, if it names one
    if m := _COLOR_EDIT_RE.fullmatch(clean):
        kind, named, target["color"] = "color", m.group(1), m.group(2)
    elif m := _SHAPE_EDIT_RE.fullmatch(clean):
        kind, named, target["shape"] = "shape", m.group(1), m.group(2)
    elif m := _MOVE_EDIT_RE.fullmatch(clean):
        kind, (target["row"], target["col"]) = "position", POSITIONS[m.group(1)]
    elif m := _SIZE_EDIT_RE.fullmatch(clean):
        kind, target["size"] = "size", m.group(1)
    else:
        raise ValueError(f"cannot parse shapes edit instruction {text!r}")
    source_shape = _as_attributes(source)["shape"]
    if named is not None and named != source_shape:
        raise ValueError(f"instruction {text!r} names a {named} but the source shows a {source_shape}")
    return kind, target


def parse_instruction(text: str, source: ShapeSpec | dict[str, Any]) -> dict[str, Any]:
    """'make the circle blue' + source attributes -> target attributes {shape, color, size, row, col}."""
    return parse_instruction_kind(text, source)[1]


def edit_from_instruction(text: str, source: ShapeSpec) -> EditSpec:
    """Build the EditSpec an instruction asks for, given the source scene."""
    kind, target = parse_instruction_kind(text, source)
    value = (target["row"], target["col"]) if kind == "position" else target[kind]
    return replace(apply_edit(source, kind, value), instruction=text)
