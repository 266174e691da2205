"""Griffe extension of the documentation site (mkdocs.yml, mkdocstrings ``extensions:``):
the package's docstrings are Google style with reST inline markup (``code``,
:class:`~zero_runtime.config.ZeroConfig`); mkdocstrings renders Markdown, so each
docstring's inline markup is turned into Markdown before it is parsed."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?\w+:`(~?)([^`<>]+)`")
_DOUBLE = re.compile(r"(?<!`)``(?!`)")  # not part of a ``` fence
_LITERAL = re.compile(r"(?m)(\S)::$|^\s*::\n")  # "text::" before an indented block


def _role(match: re.Match[str]) -> str:
    # Sphinx shows ``~a.b.c`` as ``c`` and ``a.b.c`` in full.
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


def rst_to_md(text: str) -> str:
    """reST inline markup as Markdown.

    ``:class:`~a.B``` -> ```B```, ``:func:`a.f``` -> ```a.f```, reST's double-backtick
    literals ``x`` -> `x`, and a literal block's ``text::`` -> ``text:`` (its indented
    block is a Markdown code block as it is). Other text is returned unchanged.
    """
    text = _LITERAL.sub(lambda m: f"{m.group(1)}:" if m.group(1) else "", text)
    return _DOUBLE.sub("`", _ROLE.sub(_role, text))


class RstInlineMarkup(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`rst_to_md`."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Griffe event: called once per object after the package is loaded."""
        if obj.docstring is not None:
            obj.docstring.value = rst_to_md(obj.docstring.value)
