"""Checks of option values, shared by the connector's own keys and every tier's: each raises a
one-line ValueError naming the key, what it got (shortened) and what it takes."""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SHOWN_CHARS = 80  # of a bad value, in an error


def show(value: Any) -> str:
    """repr(value), at most about SHOWN_CHARS characters (a config may carry a huge value)."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} chars)"


def did_you_mean(given: Any, choices: Sequence[str]) -> str:
    """' (did you mean 'x'?)' for the choice closest to `given` (case aside), else ''."""
    if not isinstance(given, str) or len(given) > SHOWN_CHARS:
        return ""
    folded = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(given.lower(), list(folded), n=1, cutoff=0.6)
    return f" (did you mean {folded[close[0]]!r}?)" if close else ""


def check_bytes(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive integer of bytes, got {show(value)}")


def check_seconds(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(value) or value <= 0:
        raise ValueError(f"{key} must be a positive number of seconds, got {show(value)}")


def check_flag(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {show(value)}")


def check_text(key: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string, got {show(value)}")


def check_choice(key: str, value: Any, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{key} must be one of {tuple(choices)}, got {show(value)}"
                         f"{did_you_mean(value, choices)}")


def check_readable_file(key: str, path: str | None) -> None:
    if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
        raise ValueError(f"{key} {show(path)} is not a readable file")


@dataclass(frozen=True)
class Option:
    """One option key: its `default` (None: unset) and `check(key, value)`, which raises a
    ValueError naming a value the key never takes (run on every value given, tier on or off)."""

    default: Any = None
    check: Callable[[str, Any], None] | None = None
