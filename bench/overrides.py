"""Module constants set from the command line ("module.CONST=value,..."; values Python literals):
how a GPU run checks or times a flag of the code without editing it."""

from __future__ import annotations

import ast
import contextlib
import importlib


def set_constants(assigns: str) -> list[tuple]:
    """Set each constant; returns (module, name, old value) triples for ``restore``."""
    saved = []
    for a in filter(None, _top_level_split(assigns)):
        target, _, value = a.partition("=")
        mod_name, _, const = target.strip().rpartition(".")
        mod = importlib.import_module(mod_name)
        if not hasattr(mod, const):
            raise SystemExit(f"{mod_name} has no constant {const!r}")
        saved.append((mod, const, getattr(mod, const)))
        setattr(mod, const, ast.literal_eval(value.strip()))
    return saved


def _top_level_split(assigns: str) -> list[str]:
    """``assigns`` split at the commas outside brackets (a value may be a dict or a tuple)."""
    parts, depth, cur = [], 0, ""
    for ch in assigns:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def restore(saved: list[tuple]) -> None:
    for mod, const, value in reversed(saved):
        setattr(mod, const, value)


@contextlib.contextmanager
def constants(assigns: str):
    """``set_constants`` for the duration of a ``with`` block."""
    saved = set_constants(assigns)
    try:
        yield
    finally:
        restore(saved)
