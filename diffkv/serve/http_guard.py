"""The checks ``diffkv serve`` makes before any work on a request (the connection layer is
:mod:`diffkv.serve.http_conn`).

:class:`Guard` holds one server's policy: which ``Host`` headers it answers (a DNS-rebinding page sends its own
name), which browser ``Origin`` values it allows (CORS), the optional API key. Each check returns or raises
:class:`~diffkv.serve.openai_api.APIError` with an OpenAI error body.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from diffkv.core.errors import UsageError
from diffkv.serve.openai_api import APIError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ANY_ADDRESS = ("", "0.0.0.0", "::")


def split_host(value: str) -> tuple[str, int | None]:
    """``"Name:8000"`` -> ``("name", 8000)``, ``"[::1]:80"`` -> ``("::1", 80)``, no port -> ``None``; ValueError if
    malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or rest and not rest.startswith(":"):
            raise ValueError(value)
        port = rest[1:] if rest else None
    elif value.count(":") == 1:
        name, port = value.split(":")
    elif ":" in value:
        raise ValueError(value)  # an IPv6 address needs brackets
    else:
        name, port = value, None
    name = name.rstrip(".")
    if not name or port is not None and not (port.isascii() and port.isdigit() and len(port) <= 5):
        raise ValueError(value)
    return name, None if port is None else int(port)


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _origin(text: str) -> str:
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
        raise UsageError(f"--cors-origin {text!r} is not an origin: write it as scheme://host[:port], e.g. "
                         "http://localhost:3000, or * for any")
    return f"{parts.scheme}://{parts.netloc}".lower()


class Guard:
    """The request policy of one server bound to ``bind_host``:``port``.

    ``allowed_hosts``: extra names for the ``Host`` header (``name`` any port, ``name:port`` that port, ``*``
    anything). Always accepted with the bound port: the loopback names, the bound address, and when bound to every
    interface (0.0.0.0, ::) any IP address (DNS rebinding needs a name; an address is never rebound).
    ``cors_origins``: browser origins allowed to call (``*`` any); a request with any other ``Origin`` is refused.
    ``api_key``: when set, every route but ``/health`` needs ``Authorization: Bearer <key>``.
    """

    def __init__(self, bind_host: str, port: int, allowed_hosts=(), cors_origins=(), api_key: str | None = None):
        self.port = port
        bound = bind_host.strip("[]").lower()
        self.local, self.any_ip = {*LOOPBACK, bound}, bound in ANY_ADDRESS
        self.any_host = "*" in allowed_hosts
        self.hosts = set()
        for entry in allowed_hosts:
            if entry != "*":
                try:
                    self.hosts.add(split_host(entry))
                except ValueError:
                    raise UsageError(f"--allowed-hosts entry {entry!r} is not a host name: write name or "
                                     "name:port, comma-separated, or * for any") from None
        self.any_origin = "*" in cors_origins
        self.origins = {_origin(o) for o in cors_origins if o != "*"}
        if api_key is not None and not api_key:
            raise UsageError("--api-key is empty: give a secret, or leave the option out")
        self.api_key = api_key.encode() if api_key else None

    def check_host(self, headers) -> None:
        values = headers.get_all("Host") or []
        if len(values) != 1:
            raise APIError(400, "a request needs exactly one Host header", code="invalid_host")
        if self.any_host:
            return
        try:
            name, port = split_host(values[0])
        except ValueError:
            raise APIError(400, f"bad Host header {values[0][:80]!r}", code="invalid_host") from None
        local = name in self.local or self.any_ip and _is_ip(name)
        if local and (port == self.port or port is None and self.port == 80):
            return
        if (name, None) in self.hosts or (name, port) in self.hosts:
            return
        raise APIError(403, f"this server does not answer for Host {values[0][:80]!r}: start it with "
                       "--allowed-hosts to add the name", code="host_not_allowed")

    def check_origin(self, headers) -> str | None:
        """The ``Origin`` to answer with CORS headers, None for a request without one (not from a browser page)."""
        values = headers.get_all("Origin") or []
        if not values:
            return None
        origin = values[0].strip()
        if len(values) == 1 and (self.any_origin or origin.rstrip("/").lower() in self.origins):
            return origin
        raise APIError(403, f"cross-origin requests from {origin[:80]!r} are refused (allow an origin with "
                       "--cors-origin)", code="origin_not_allowed")

    def check_api_key(self, headers) -> None:
        if self.api_key is None:
            return
        scheme, _, token = headers.get("Authorization", "").strip().partition(" ")
        given = token.strip().encode("latin-1", "replace")  # the header's bytes (http.server decodes latin-1)
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given, self.api_key)):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def check_json_body(headers) -> None:
    """POST bodies must be ``application/json`` (parameters such as ``charset`` allowed): a browser page can send
    ``text/plain`` cross-site without a CORS preflight, never ``application/json``."""
    ctype = headers.get("Content-Type", "")
    if ctype.partition(";")[0].strip().lower() != "application/json":
        raise APIError(415, f"the body must be JSON sent with 'Content-Type: application/json', not {ctype[:80]!r}",
                       code="unsupported_media_type")


def cors_headers(origin: str, headers, preflight: bool) -> dict:
    """The CORS headers answering an allowed ``origin`` (and its preflight ``OPTIONS``)."""
    out = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight:
        out["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
        out["Access-Control-Allow-Headers"] = headers.get("Access-Control-Request-Headers",
                                                          "Authorization, Content-Type")[:1000]
        out["Access-Control-Max-Age"] = "600"
    return out
