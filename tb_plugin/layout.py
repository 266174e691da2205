"""How the read side decodes a tag's layout, and its error for undecodable data.

A tag's summary metadata (written by :mod:`tb_plugin.summary`, defined in
:mod:`tb_plugin.metadata`) says what one datum is: a matrix (rows x columns), a vector
(columns) or a JSON record. :func:`parse_layout` turns it into a :class:`Layout`, and
:class:`DataContractError` is what every route answers (HTTP 500, as JSON) when stored
summaries cannot be decoded: a newer schema version, metadata that is not the documented
JSON object, a tensor of the wrong shape, a record that is not UTF-8 JSON.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tensorboard import errors

from tb_plugin import metadata


class DataContractError(errors.PublicError):
    """Stored summaries that this reader cannot decode (HTTP 500).

    Raised for a schema version newer than :data:`tb_plugin.metadata.SCHEMA_VERSION`,
    a metadata content that is not the documented JSON object, or a tensor whose shape
    does not match its layout. The message names the run, the tag and the reason.
    """

    http_code = 500

    def __init__(self, details: str) -> None:
        super().__init__(f"Cannot decode memory_hierarchy data: {details}")


@dataclass(frozen=True)
class Layout:
    """A tag's layout as stored in its summary metadata (see :mod:`tb_plugin.metadata`)."""

    version: int
    kind: str  # metadata.KIND_MATRIX | KIND_VECTOR | KIND_JSON
    rows: tuple[str, ...]  # matrix row names; empty for vector and json
    columns: tuple[str, ...]  # column names; empty for json
    units: tuple[str, ...]  # parallel to columns

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor shape one datum of this layout has."""
        if self.kind == metadata.KIND_MATRIX:
            return (len(self.rows), len(self.columns))
        if self.kind == metadata.KIND_VECTOR:
            return (len(self.columns),)
        return ()


def parse_layout(content: bytes, run: str, tag: str) -> Layout:
    """Decode a summary's plugin content into a :class:`Layout`.

    Args:
        content: ``plugin_data.content`` of the time series.
        run: the run name, for error messages.
        tag: the tag name, for error messages.

    Returns:
        The layout.

    Raises:
        DataContractError: newer schema version, or not the documented JSON object.
    """
    try:
        parsed = metadata.parse_plugin_metadata(content)
    except ValueError as exc:  # includes metadata.UnsupportedSchemaError
        raise DataContractError(f"run {run!r}, tag {tag!r}: {exc}") from exc
    kind = parsed.get("kind")
    if kind not in (metadata.KIND_MATRIX, metadata.KIND_VECTOR, metadata.KIND_JSON):
        raise DataContractError(f"run {run!r}, tag {tag!r}: unknown layout kind {kind!r}")
    try:
        rows, columns, units = (
            tuple(str(x) for x in parsed.get(key, [])) for key in ("rows", "columns", "units")
        )
    except TypeError as exc:
        raise DataContractError(f"run {run!r}, tag {tag!r}: malformed layout") from exc
    return Layout(parsed["version"], kind, rows, columns, units)


@functools.lru_cache(maxsize=4096)
def cached_layout(content: bytes, run: str, tag: str) -> Layout:
    """:func:`parse_layout`, parsed once per distinct ``(content, run, tag)``."""
    return parse_layout(content, run, tag)
