"""Reading a config given as JSON text or as the path of a JSON file."""

from __future__ import annotations

import json
import os
from typing import Any

from zero_runtime.config.errors import ZeroConfigError, ZeroConfigFileNotFoundError


def load_json_object(path_or_str: str | os.PathLike[str], what: str = "config") -> dict[str, Any]:
    """Parse JSON text or a JSON file into a dict.

    A string is JSON text when it starts with ``{`` or ``[``, or when it parses as JSON and
    names no existing file (``"null"``, ``"3"``); otherwise it is a path.

    Args:
        path_or_str: JSON text, or the path of a JSON file.
        what: what the input is, for messages (``"config"``, ``"DeepSpeed config"``).

    Raises:
        ZeroConfigError: invalid JSON or a top-level value that is not an object.
        ZeroConfigFileNotFoundError: a path (not JSON text) where no file exists; it is
            both a ``ZeroConfigError`` and a ``FileNotFoundError``.
        OSError: an existing file that cannot be read.
    """
    accepted = (
        "a JSON object as text (e.g. '{\"stage\": 2}') or the path of a JSON file holding one"
    )
    text = _json_text(path_or_str)
    if text is not None:
        source = "<string>"
    else:
        source = os.fspath(path_or_str)
        if not os.path.exists(source):
            raise ZeroConfigFileNotFoundError(
                f"{what} {_shorten(source)} is neither JSON text nor the path of an existing "
                f"file; expected {accepted}",
                value=source,
                accepted=accepted,
            )
        with open(source, encoding="utf-8") as fh:
            text = fh.read()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ZeroConfigError(
            f"invalid JSON in {source}: {e}; expected {accepted}", value=text, accepted=accepted
        ) from None
    if not isinstance(obj, dict):
        given = f"JSON text {_shorten(text)}" if source == "<string>" else f"file {source!r}"
        raise ZeroConfigError(
            f"JSON in {source} must be an object, got {type(obj).__name__} ({what} given: "
            f"{given}); expected {accepted}",
            value=obj,
            accepted=accepted,
        )
    return obj


def _json_text(path_or_str: str | os.PathLike[str]) -> str | None:
    """``path_or_str`` itself when it is JSON text rather than a path, else None."""
    if not isinstance(path_or_str, str):
        return None
    stripped = path_or_str.strip()
    if stripped.startswith(("{", "[")):
        return path_or_str
    if not stripped or os.path.exists(path_or_str):
        return None
    try:
        json.loads(stripped)
    except json.JSONDecodeError:
        return None
    return path_or_str


def _shorten(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut to about ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")
