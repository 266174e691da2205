"""The errors of an invalid configuration (every module of ``zero_runtime.config`` raises
these)."""

from __future__ import annotations

from typing import Any


class ZeroConfigError(ValueError):
    """An invalid configuration value, key or combination of values.

    Attributes:
        key: the offending key (str), or None when the error is not about one key
            (e.g. the input is not a mapping, or invalid JSON).
        value: the offending value (any type), or None.
        accepted: human-readable description of what is accepted (str), or None.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        value: Any = None,
        accepted: str | None = None,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.value = value
        self.accepted = accepted


class ZeroConfigFileNotFoundError(ZeroConfigError, FileNotFoundError):
    """A config given as a path (not JSON text) where no file exists.

    Both a ``ZeroConfigError`` (a ``ValueError``: bad input) and a ``FileNotFoundError``
    (what ``open`` would raise), so either ``except`` catches it. ``value`` is the path.
    """
