"""``GET /<asset>``: the built frontend (``index.js`` and what it loads) from ``static/``.

Only plain file names of the served types are answered; anything that could walk out of
the static directory (separators, ``..``, percent signs, symlinks leading out) is refused.
"""

from __future__ import annotations

import hashlib
import os
import re

from tensorboard import errors
from tensorboard.backend import http_util
from werkzeug import wrappers

from tb_plugin import metadata, routing

STATIC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "static")

# Content types of the static assets the frontend build produces; other files are 404.
CONTENT_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".map": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
# A static asset is a plain file name in STATIC_DIR: no separators, no leading dot, no
# percent sign (so neither encoded nor doubly encoded ".." can get through).
_ASSET_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
_STATIC_PREFIX = f"/data/plugin/{metadata.PLUGIN_NAME}/"


def static_impl(static_dir: str, name: str) -> tuple[bytes, str]:
    """Read one built frontend asset from the static directory.

    Args:
        static_dir: the directory of the built frontend (:data:`STATIC_DIR`).
        name: the file name requested (the path after the plugin prefix).

    Returns:
        ``(content, content_type)``.

    Raises:
        InvalidArgumentError: ``name`` is not a plain file name (separators,
            backslashes, ``..``, percent signs, absolute paths).
        NotFoundError: no such asset, or an asset type that is not served.
    """
    if not _ASSET_NAME.fullmatch(name):
        raise errors.InvalidArgumentError(f"not a static asset name: {name[:80]!r}")
    content_type = CONTENT_TYPES.get(os.path.splitext(name)[1])
    root = os.path.realpath(static_dir)
    path = os.path.realpath(os.path.join(root, name))
    if content_type is None or os.path.dirname(path) != root or not os.path.isfile(path):
        hint = ""
        if name == "index.js":
            hint = " (the frontend is not built: run scripts/setup.sh)"
        raise errors.NotFoundError(f"no static asset {name!r}{hint}")
    with open(path, "rb") as f:
        return f.read(), content_type


def etag(content: bytes) -> str:
    """The strong ETag of an asset's bytes: a quoted SHA-256 prefix (32 hex digits)."""
    return '"' + hashlib.sha256(content).hexdigest()[:32] + '"'


@wrappers.Request.application
@routing.json_errors
def static_route(static_dir: str, request: wrappers.Request) -> wrappers.Response:
    """GET /<asset>: see :func:`static_impl`.

    Every answer carries an ``ETag`` and ``Cache-Control: no-cache, must-revalidate``
    (the asset names carry no version, so the browser asks again each visit); a request
    whose ``If-None-Match`` names the current ETag gets ``304 Not Modified`` and no body.
    """
    path = request.path
    name = path[len(_STATIC_PREFIX) :] if path.startswith(_STATIC_PREFIX) else path
    content, content_type = static_impl(static_dir, name)
    tag = etag(content)
    if request.if_none_match.contains(tag.strip('"')):
        return wrappers.Response(
            status=304,
            headers=[("ETag", tag), ("Cache-Control", "no-cache, must-revalidate")],
        )
    return http_util.Respond(request, content, content_type, headers=[("ETag", tag)])
