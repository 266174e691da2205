"""The DNS-rebinding guard of the plugin's writing route (``POST /tune``).

DNS rebinding: a page at ``http://evil.example:6006`` whose name the attacker then points
at 127.0.0.1 is, to the browser, same-origin with the TensorBoard on this machine, so the
custom header and Content-Type checks of ``POST /tune`` (which stop cross-site requests)
do not stop it. What gives it away is the name: its requests carry
``Host: evil.example:6006`` and ``Origin: http://evil.example:6006``. So a write is
accepted only when

- ``Host`` names an address this TensorBoard serves (:meth:`ServedAddress.allows`):
  a loopback name (``localhost``, ``*.localhost``, 127.0.0.0/8, ``::1``) on any port
  (a loopback name cannot be rebound by an outside page; a different port is a local
  forward such as ``ssh -L 16006:localhost:6006``), or, on the port the server is bound
  to, the bound address itself, TensorBoard's ``--host``, and with ``--bind_all`` (or a
  wildcard ``--host``) any IP literal and this machine's host name (IP literals and the
  machine's own names are not the attacker's to point elsewhere);
- ``Origin``, when sent (browsers send it on every POST), is ``http(s)://`` + that same
  ``Host``: the page that posts is served by this TensorBoard under the name it was asked
  by. ``Origin: null`` (a sandboxed frame, a file) is refused.

The bound address comes from the WSGI environ (``SERVER_NAME``, ``SERVER_PORT``: what
werkzeug's server, which TensorBoard uses, is listening on) and TensorBoard's flags
(``--host``, ``--bind_all``). Nothing here does HTTP; the route maps a refusal to 403.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tensorboard import errors

WILDCARD_HOSTS = ("", "0.0.0.0", "::")  # bound to every interface (--bind_all)
LOOPBACK_NAME = "localhost"
# host[:port] as it may appear in a Host header: a name or IPv4, or a bracketed IPv6.
_HOST_HEADER = re.compile(r"(?P<name>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(?P<port>[0-9]{1,5}))?")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class RebindingRefusedError(errors.PublicError):
    """A write whose ``Host`` or ``Origin`` is not an address this TensorBoard serves
    (HTTP 403); the message names the header, its value and what is accepted."""

    http_code = 403


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """Whether a host name (lower case, IPv6 possibly bracketed) is a loopback address."""
    if name == LOOPBACK_NAME or name.endswith("." + LOOPBACK_NAME):
        return True
    ip = _ip(name)
    return ip is not None and ip.is_loopback


@dataclass(frozen=True)
class ServedAddress:
    """Where this TensorBoard listens, and so which names a write may come in under.

    Attributes:
        bound_host: the address the server is bound to (``SERVER_NAME``; ``"::"`` or
            ``"0.0.0.0"`` with ``--bind_all``), lower case.
        port: the bound port (``SERVER_PORT``).
        host_flag: TensorBoard's ``--host`` (lower case), None when not given.
        bind_all: TensorBoard's ``--bind_all``.
    """

    bound_host: str
    port: int
    host_flag: str | None = None
    bind_all: bool = False

    @classmethod
    def from_request(cls, environ: Mapping[str, Any], flags: Any) -> ServedAddress:
        """The served address of one request (its environ) under TensorBoard's flags."""
        host_flag = getattr(flags, "host", None)
        try:
            port = int(environ.get("SERVER_PORT") or 0)
        except ValueError:
            port = 0
        return cls(
            bound_host=str(environ.get("SERVER_NAME") or "").lower().strip("[]"),
            port=port,
            host_flag=str(host_flag).lower().strip("[]") if host_flag else None,
            bind_all=bool(getattr(flags, "bind_all", False)),
        )

    @property
    def wildcard(self) -> bool:
        """Bound to every interface (``--bind_all`` or a wildcard ``--host``)."""
        hosts = (self.bound_host, self.host_flag)
        return self.bind_all or any(h in WILDCARD_HOSTS for h in hosts if h is not None)

    def names(self) -> set[str]:
        """The non-loopback names accepted on :attr:`port` (besides any IP with a wildcard)."""
        names = {self.bound_host, self.host_flag or ""} - set(WILDCARD_HOSTS)
        if self.wildcard:
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        return names

    def allows(self, name: str, port: int) -> bool:
        """Whether ``Host: name:port`` is an address this server answers under."""
        if is_loopback(name):
            return True
        if port != self.port:
            return False
        bare = name.strip("[]")
        return bare in self.names() or (self.wildcard and _ip(bare) is not None)

    def describe(self) -> str:
        """The accepted names, for an error message."""
        named = sorted(self.names())
        extra = " or any IP address" if self.wildcard else ""
        listed = ", ".join(named) if named else "no other name"
        loopback = "localhost or a loopback address (any port)"
        return f"{loopback}, or on port {self.port}: {listed}{extra}"


def check_same_origin(environ: Mapping[str, Any], flags: Any, route: str) -> None:
    """Refuse a write that did not come in under an address this TensorBoard serves.

    Args:
        environ: the request's WSGI environ (``HTTP_HOST``, ``HTTP_ORIGIN``,
            ``SERVER_NAME``, ``SERVER_PORT``, ``wsgi.url_scheme``).
        flags: TensorBoard's parsed flags (``host``, ``bind_all``; absent = not given).
        route: the route's name for the message (``"POST /tune"``).

    Raises:
        RebindingRefusedError: ``Host`` missing, malformed or not served here
            (:meth:`ServedAddress.allows`); ``Origin`` present and not
            ``http(s)://`` + the ``Host`` (``null`` included).
    """
    served = ServedAddress.from_request(environ, flags)
    host = str(environ.get("HTTP_HOST") or "")
    scheme = str(environ.get("wsgi.url_scheme") or "http")
    match = _HOST_HEADER.fullmatch(host)
    if match is None:
        raise RebindingRefusedError(
            f"{route} refused: Host header {host[:80]!r} is not host[:port] (a DNS rebinding "
            "guard); nothing was written"
        )
    name = match.group("name").lower()
    port = int(match.group("port") or _DEFAULT_PORTS.get(scheme, 80))
    if not served.allows(name, port):
        raise RebindingRefusedError(
            f"{route} refused: Host {host[:80]!r} is not an address this TensorBoard serves "
            f"(a DNS rebinding guard); accepted: {served.describe()}. Open TensorBoard "
            "under one of those names, or start it with --host set to the name you use; "
            "nothing was written"
        )
    origin = environ.get("HTTP_ORIGIN")
    if origin is None:
        return  # not a browser (curl, urllib): the Host check is what matters
    parts = urlsplit(str(origin))
    if parts.scheme not in _DEFAULT_PORTS or parts.netloc.lower() != host.lower():
        raise RebindingRefusedError(
            f"{route} refused: Origin {str(origin)[:80]!r} is not this TensorBoard's "
            f"page at {scheme}://{host[:80]} (a DNS rebinding and cross-site guard); "
            "nothing was written"
        )
