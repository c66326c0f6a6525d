"""Who may act: the dashboard's token, its sessions and their CSRF tokens.

Started without a token the dashboard is read-only: every action is refused. Started with
one, an operator logs in by typing it (``POST /login``); the session is a random id in an
``HttpOnly``, ``SameSite=Strict`` cookie, held in memory (a restart logs everyone out).
Every action is a POST that must carry the session's CSRF token in its form, come from the
dashboard's own pages (an ``Origin`` or ``Referer`` of another site is refused), and find
the session cookie: a page of another site can neither read the token nor send the cookie.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

COOKIE = "outbox_dashboard"
#: A session ends this long after its login.
SESSION_SECONDS = 12 * 3600
#: Sessions kept at most (the oldest go first).
MAX_SESSIONS = 1000
#: A wrong token is answered after this pause: guessing costs time.
WRONG_TOKEN_PAUSE = 1.0

READ_ONLY = (
    "read-only: the dashboard was started without a token (--token or OUTBOX_DASHBOARD_TOKEN)"
)
NOT_LOGGED_IN = "log in with the dashboard's token first"
BAD_CSRF = "the form's CSRF token is missing or stale: reload the page and try again"
FOREIGN = "refused: the request did not come from the dashboard's own pages"


@dataclass
class Session:
    id: str
    csrf: str
    started: float
    #: Lines to show on the next page (what the last action did).
    notes: list[str] = field(default_factory=list)


class Guard:
    """The token and the sessions logged in with it."""

    def __init__(self, token: str | None) -> None:
        if token is not None and not token.strip():
            raise ValueError("the dashboard's token must not be empty")
        self._token = token
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    @property
    def read_only(self) -> bool:
        return self._token is None

    def login(self, given: str) -> Session | None:
        """A new session when ``given`` is the token, else None (after a pause)."""
        if self._token is None or not hmac.compare_digest(given.encode(), self._token.encode()):
            time.sleep(WRONG_TOKEN_PAUSE)
            return None
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), time.monotonic())
        with self._lock:
            self._expire()
            while len(self._sessions) >= MAX_SESSIONS:
                self._sessions.pop(next(iter(self._sessions)))
            self._sessions[session.id] = session
        return session

    def logout(self, cookies: Mapping[str, str]) -> None:
        with self._lock:
            self._sessions.pop(cookies.get(COOKIE, ""), None)

    def session(self, cookies: Mapping[str, str]) -> Session | None:
        """The session of the request's cookie, if it is one still open."""
        if self._token is None:
            return None
        with self._lock:
            self._expire()
            return self._sessions.get(cookies.get(COOKIE, ""))

    def refusal(
        self, cookies: Mapping[str, str], form: Mapping[str, str], headers: Mapping[str, str]
    ) -> str | None:
        """Why an action must be refused, or None when it may run."""
        if self._token is None:
            return READ_ONLY
        if not same_origin(headers):
            return FOREIGN
        session = self.session(cookies)
        if session is None:
            return NOT_LOGGED_IN
        if not hmac.compare_digest(form.get("csrf", "").encode(), session.csrf.encode()):
            return BAD_CSRF
        return None

    def _expire(self) -> None:
        cutoff = time.monotonic() - SESSION_SECONDS
        for sid in [sid for sid, s in self._sessions.items() if s.started < cutoff]:
            del self._sessions[sid]


def same_origin(headers: Mapping[str, str]) -> bool:
    """The request's ``Origin`` (or, without one, its ``Referer``) names the host it was sent
    to; a request with neither (not from a browser's page) passes: the CSRF token decides."""
    host = headers.get("host", "")
    origin = headers.get("origin") or headers.get("referer")
    if not origin:
        return True
    if origin == "null":  # a sandboxed frame or a privacy redirect: not the dashboard's page
        return False
    return urlsplit(origin).netloc == host
