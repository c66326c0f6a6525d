"""The dashboard's HTTP plumbing over WSGI: a request read whole, a response with the
headers every page gets.

Every response forbids scripts altogether (``Content-Security-Policy``: no script source is
allowed), framing and caching: a message's value is shown as text by the templates'
autoescaping, and were a value to get past it, the browser would still run nothing.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs, urlsplit

#: The largest form accepted (the dashboard's forms carry a few ids).
MAX_FORM_BYTES = 64 * 1024

SECURITY_HEADERS = (
    (
        "Content-Security-Policy",
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "same-origin"),
    ("Cache-Control", "no-store"),
)

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    form: dict[str, str]
    cookies: dict[str, str]
    #: Lower-case names.
    headers: dict[str, str]

    @classmethod
    def from_environ(cls, environ: Mapping[str, Any]) -> Request:
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        form: dict[str, str] = {}
        if method == "POST":
            try:
                length = int(environ.get("CONTENT_LENGTH") or 0)
            except ValueError:
                length = 0
            if length > MAX_FORM_BYTES:
                raise TooLarge()
            body = environ["wsgi.input"].read(length) if length else b""
            form = _first_values(body.decode("utf-8", errors="replace"))
        headers = {
            key[5:].replace("_", "-").lower(): str(value)
            for key, value in environ.items()
            if key.startswith("HTTP_")
        }
        cookies: dict[str, str] = {}
        if "cookie" in headers:
            jar: SimpleCookie = SimpleCookie()
            try:
                jar.load(headers["cookie"])
            except Exception:  # a malformed cookie header is no cookie
                jar = SimpleCookie()
            cookies = {name: morsel.value for name, morsel in jar.items()}
        return cls(
            method=method,
            path=str(environ.get("PATH_INFO") or "/"),
            query=_first_values(str(environ.get("QUERY_STRING", ""))),
            form=form,
            cookies=cookies,
            headers=headers,
        )

    def arg(self, name: str) -> str | None:
        """A query argument, stripped; None when absent or empty."""
        value = self.query.get(name, "").strip()
        return value or None

    def field(self, name: str) -> str | None:
        """A form field, stripped; None when absent or empty."""
        value = self.form.get(name, "").strip()
        return value or None


class TooLarge(Exception):
    """A request body over MAX_FORM_BYTES."""


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "text/html; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def redirect(cls, location: str, headers: Iterable[tuple[str, str]] = ()) -> Response:
        """A 303: the browser follows it with a GET (a reload repeats no action)."""
        return cls(303, b"", "text/plain", [("Location", location), *headers])

    def send(self, start_response: StartResponse) -> list[bytes]:
        headers = [
            ("Content-Type", self.content_type),
            ("Content-Length", str(len(self.body))),
            *SECURITY_HEADERS,
            *self.headers,
        ]
        start_response(f"{self.status} {HTTPStatus(self.status).phrase}", headers)
        return [self.body]


def local_path(value: str | None, default: str = "/") -> str:
    """``value`` when it is a path of this site (``/dead?topic=x``), else ``default``: a
    redirect never leads elsewhere."""
    if not value or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return default
    parts = urlsplit(value)
    if parts.scheme or parts.netloc:
        return default
    return value


def is_loopback(host: str) -> bool:
    """``host`` names this machine only (``localhost``, ``127.0.0.0/8``, ``::1``)."""
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name part of a ``Host`` header (``127.0.0.1:8080`` -> ``127.0.0.1``)."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if ":" in host_header else host_header


def _first_values(text: str) -> dict[str, str]:
    return {name: values[0] for name, values in parse_qs(text, keep_blank_values=True).items()}
