"""The dashboard as a WSGI application: its pages and its actions.

Pages are GETs that read (:mod:`outbox.dashboard.reads`) and render a template; actions are
POSTs that the guard lets through (:mod:`outbox.dashboard.guard`), run the function the
command line runs in one transaction, note what they did in the session and redirect back
to the page (a reload repeats nothing).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import jinja2
from sqlalchemy.exc import SQLAlchemyError

from outbox.dashboard.guard import COOKIE, SESSION_SECONDS, Guard, Session, same_origin
from outbox.dashboard.reads import CAUSE_LIMIT, PER_GROUP, Reads
from outbox.dashboard.web import (
    Request,
    Response,
    StartResponse,
    TooLarge,
    host_name,
    is_loopback,
    local_path,
)
from outbox.database_errors import first_line
from outbox.errors import OutboxError
from outbox.prepared.decisions import CHECK_TIMEOUT
from outbox.redaction import mask_secrets
from outbox.status_report import age, shard_ranges

if TYPE_CHECKING:
    from outbox.prepared.checkers import CheckRegistry

Page = Callable[["Dashboard", Request], Response]
ROUTES: dict[tuple[str, str], Page] = {}


def route(method: str, path: str) -> Callable[[Page], Page]:
    def register(page: Page) -> Page:
        ROUTES[(method, path)] = page
        return page

    return register


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("outbox.dashboard", "templates"),
        # Every value is escaped: a message's value, key, headers and errors are text.
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        age=age,
        shards=shard_ranges,
        text=as_text,
        masked=lambda value: mask_secrets(as_text(value)),
        summary=summary,
        when=when,
        count=lambda n: "-" if n is None else f"{n:,}",
    )
    return env


class Dashboard:
    """The WSGI application. ``sources`` name the databases it reads (shown masked);
    ``loopback_only``: answer only requests addressed to a loopback host name, so that a
    page of another site cannot reach the dashboard by pointing a name of its own at
    127.0.0.1 (DNS rebinding). ``checkers``: the registry a prepared message's rollback asks
    first, as ``outbox prepared rollback --checker`` does, each checker for at most
    ``check_timeout`` seconds; without one a rollback needs the operator's word that the step
    cannot happen (``--step-cannot-happen``)."""

    def __init__(
        self,
        reads: Reads,
        guard: Guard,
        *,
        refresh: float = 10,
        loopback_only: bool = True,
        sources: Iterable[str] = (),
        checkers: CheckRegistry | None = None,
        check_timeout: float = CHECK_TIMEOUT,
    ) -> None:
        self.reads = reads
        self.guard = guard
        self.checkers = checkers
        self.check_timeout = check_timeout
        # Whole seconds: a meta refresh of 0 would reload the page without end.
        self.refresh = math.ceil(refresh) if refresh > 0 else 0
        self.loopback_only = loopback_only
        self.sources = [mask_secrets(source) for source in sources]
        self.templates = _environment()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        try:
            request = Request.from_environ(environ)
        except TooLarge:
            return Response(413, b"request too large\n", "text/plain").send(start_response)
        if self.loopback_only and not is_loopback(host_name(request.headers.get("host", ""))):
            body = b"this dashboard answers requests to a loopback address only\n"
            return Response(421, body, "text/plain").send(start_response)
        return self.handle(request).send(start_response)

    def handle(self, request: Request) -> Response:
        page = ROUTES.get((request.method, request.path))
        if page is None:
            if any(path == request.path for _, path in ROUTES):
                return Response(405, b"method not allowed\n", "text/plain")
            return self.render(request, "error.html", status=404, error="no such page")
        try:
            return page(self, request)
        except OutboxError as exc:
            return self.render(request, "error.html", status=400, error=mask_secrets(str(exc)))
        except SQLAlchemyError as exc:
            error = f"database error: {mask_secrets(first_line(exc))}"
            return self.render(request, "error.html", status=503, error=error)

    def render(self, request: Request, template: str, status: int = 200, **values: Any) -> Response:
        session = self.guard.session(request.cookies)
        notes = list(session.notes) if session else []
        if session:
            session.notes.clear()
        paused = request.arg("refresh") == "off"
        back = request.path + (f"?{urlencode(request.query)}" if request.query else "")
        context = {
            "title": "",
            "refresh": 0 if paused or template == "login.html" else self.refresh,
            "pause_url": _with_query(request, refresh="off"),
            "resume_url": _with_query(request, refresh=None),
            "paused": paused,
            "read_only": self.guard.read_only,
            "can_act": session is not None,
            "csrf": session.csrf if session else "",
            "rollback_asks_checkers": self.checkers is not None,
            "back": back,
            "login_url": "/login?" + urlencode({"next": back}),
            "notes": notes,
            "sources": self.sources,
            "now": datetime.now(UTC),
            **values,
        }
        body = self.templates.get_template(template).render(context).encode()
        return Response(status, body)

    # -- actions ------------------------------------------------------------------------------

    def act(self, request: Request, action: Callable[[], str]) -> Response:
        """Run ``action`` (which returns what it did, in words) if the guard allows it."""
        refusal = self.guard.refusal(request.cookies, request.form, request.headers)
        if refusal is not None:
            return self.render(request, "error.html", status=403, error=refusal)
        session = self.guard.session(request.cookies)
        assert session is not None
        try:
            session.notes.append(action())
        except OutboxError as exc:
            session.notes.append(f"nothing done: {mask_secrets(str(exc))}")
        return Response.redirect(local_path(request.field("back")))


def _with_query(request: Request, **changes: str | None) -> str:
    query = {**request.query, **changes}
    kept = {name: value for name, value in query.items() if value is not None}
    return request.path + (f"?{urlencode(kept)}" if kept else "")


def as_text(value: Any) -> str:
    """Bytes as UTF-8 (undecodable bytes replaced), None as nothing, anything else as str."""
    if value is None:
        return ""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


def summary(value: Any) -> str:
    """An error's exception line (its type and message), without the traceback an inbox
    handler's error carries after it."""
    from outbox.inbox.error_text import split_error

    return split_error(as_text(value).strip())[0].strip()


def when(value: datetime | None) -> str:
    return "-" if value is None else f"{value.astimezone(UTC):%Y-%m-%d %H:%M:%S}"


def _message_id(text: str | None) -> uuid.UUID:
    try:
        return uuid.UUID(text or "")
    except ValueError:
        raise OutboxError(f"{text!r} is not a message id (a UUID)") from None


# -- pages ------------------------------------------------------------------------------------


@route("GET", "/")
def overview(app: Dashboard, request: Request) -> Response:
    found = app.reads.overview()
    statuses = [
        f"{name} {'?' if c.count is None else ('~' if c.estimate else '') + f'{c.count:,}'}"
        for name, c in found.status.statuses.items()
    ]
    return app.render(
        request,
        "overview.html",
        title="Overview",
        o=found,
        statuses=statuses,
        scan_interval=app.reads.scan_interval,
    )


@route("GET", "/dead")
def dead(app: Dashboard, request: Request) -> Response:
    topic, reason = request.arg("topic"), request.arg("reason")
    causes = app.reads.dead_causes(topic, reason)
    return app.render(
        request,
        "dead.html",
        title="Dead messages",
        causes=causes,
        topic=topic,
        reason=reason,
        limit=CAUSE_LIMIT if reason else PER_GROUP,
    )


@route("GET", "/parked")
def parked(app: Dashboard, request: Request) -> Response:
    group, topic, reason = request.arg("group"), request.arg("topic"), request.arg("reason")
    causes = app.reads.parked_causes(group, topic, reason)
    return app.render(
        request,
        "parked.html",
        title="Parked inbox messages",
        causes=causes,
        group=group,
        topic=topic,
        reason=reason,
        limit=CAUSE_LIMIT if reason else PER_GROUP,
        inbox_table=app.reads.inbox_store.spec.qualified_name,
    )


@route("GET", "/prepared")
def prepared(app: Dashboard, request: Request) -> Response:
    topic, group = request.arg("topic"), request.arg("group")
    rows = app.reads.unresolved(topic, group)
    return app.render(
        request,
        "prepared.html",
        title="Prepared messages",
        rows=rows,
        topic=topic,
        group=group,
        now=datetime.now(UTC),
    )


@route("GET", "/message")
def message(app: Dashboard, request: Request) -> Response:
    text = request.arg("id")
    if text is None:
        return app.render(request, "message.html", title="Look up a message", m=None)
    found = app.reads.message(_message_id(text))
    headers: list[tuple[str, Any]] = []
    if found.row is not None:
        names, values = found.row["header_names"] or [], found.row["header_values"] or []
        headers = list(zip(names, values, strict=False))
    return app.render(
        request, "message.html", title=f"Message {found.id}", m=found, headers=headers
    )


@route("GET", "/static/dashboard.css")
def stylesheet(app: Dashboard, request: Request) -> Response:
    from importlib import resources

    css = resources.files("outbox.dashboard").joinpath("static/dashboard.css").read_bytes()
    response = Response(200, css, "text/css; charset=utf-8")
    return response


@route("GET", "/healthz")
def healthz(app: Dashboard, request: Request) -> Response:
    return Response(200, b"ok\n", "text/plain")


# -- logging in -------------------------------------------------------------------------------


@route("GET", "/login")
def login_page(app: Dashboard, request: Request) -> Response:
    nxt = local_path(request.arg("next"))
    return app.render(request, "login.html", title="Log in", next=nxt, wrong=False)


@route("POST", "/login")
def login(app: Dashboard, request: Request) -> Response:
    nxt = local_path(request.field("next"))
    if not same_origin(request.headers):
        return app.render(request, "error.html", status=403, error="refused: not from this site")
    session: Session | None = (
        None if app.guard.read_only else app.guard.login(request.form.get("token", ""))
    )
    if session is None:
        return app.render(request, "login.html", status=403, title="Log in", next=nxt, wrong=True)
    cookie = f"{COOKIE}={session.id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={SESSION_SECONDS}"
    return Response.redirect(nxt, [("Set-Cookie", cookie)])


@route("POST", "/logout")
def logout(app: Dashboard, request: Request) -> Response:
    if same_origin(request.headers):
        app.guard.logout(request.cookies)
    cookie = f"{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"
    return Response.redirect("/", [("Set-Cookie", cookie)])


# -- actions ----------------------------------------------------------------------------------


@route("POST", "/dead/retry")
def retry_dead(app: Dashboard, request: Request) -> Response:
    def run() -> str:
        from outbox.operator import act_on_dead

        ids, reason = _one_or_cause(request)
        with app.reads.outbox.begin() as conn:
            count = act_on_dead(
                conn,
                app.reads.queries,
                "retry_dead",
                ids=ids,
                topic=request.field("topic"),
                reason=reason,
            )
        return f"requeued {count} dead message(s)"

    return app.act(request, run)


@route("POST", "/parked/retry")
def retry_parked(app: Dashboard, request: Request) -> Response:
    def run() -> str:
        from outbox.inbox.parked import act_on_parked

        reason = request.field("reason")
        text = request.field("id")
        if (text is None) == (reason is None):
            raise OutboxError("name one parked message (id) or one cause (reason)")
        try:
            ids = [int(text)] if text is not None else []
        except ValueError:
            raise OutboxError(f"{text!r} is not a parked message's id") from None
        with app.reads.inbox.begin() as conn:
            count = act_on_parked(
                conn,
                app.reads.inbox_store,
                "requeue",
                ids=ids,
                group=request.field("group"),
                topic=request.field("topic"),
                reason=reason,
            )
        return f"requeued {count} parked message(s): their group's consumer applies them next"

    return app.act(request, run)


@route("POST", "/prepared/commit")
def commit_prepared(app: Dashboard, request: Request) -> Response:
    def run() -> str:
        from outbox.prepared.api import after_rollback_refusal
        from outbox.prepared.decisions import decide

        message_id = _message_id(request.field("id"))
        after_rollback = request.field("after_rollback") == "1"
        store = app.reads.prepared_store
        with app.reads.outbox.begin() as conn:
            count = decide(
                conn, store, commit=True, ids=[message_id], after_rollback=after_rollback
            )
        if count:
            return f"committed {message_id}: the relay publishes it"
        if after_rollback:
            with app.reads.outbox.connect() as conn:
                row = store.rolled_back_statuses(conn, [message_id]).get(message_id)
            refusal = after_rollback_refusal(message_id, row)
            if refusal is not None:
                return f"{message_id} was not committed: {refusal}"
            return f"{message_id} was not committed: it is committed already"
        return f"{message_id} was not committed: it is not waiting for a verdict (any more)"

    return app.act(request, run)


@route("POST", "/prepared/rollback")
def rollback_prepared(app: Dashboard, request: Request) -> Response:
    def run() -> str:
        from outbox.prepared.decisions import operator_rollback

        message_id = _message_id(request.field("id"))
        # The rollback of `outbox prepared rollback`, with its rules: through the checkers,
        # or on the operator's word that the step cannot happen; StepNotBlocked otherwise.
        result = operator_rollback(
            app.reads.outbox,
            app.reads.prepared_store,
            app.checkers,
            ids=[message_id],
            step_cannot_happen=request.field("step_cannot_happen") == "1",
            check_timeout=app.check_timeout,
        )
        if result.rolled_back:
            if app.checkers is not None:
                return f"rolled back {message_id}: its checker blocked the step (ROLLBACK)"
            return (
                f"rolled back {message_id} on your word that its step cannot happen "
                "(`outbox prepared list --unblocked` lists it)"
            )
        why = result.refused.get(message_id, "it is not waiting for a verdict (any more)")
        return f"{message_id} was not rolled back: {why}"

    return app.act(request, run)


def _one_or_cause(request: Request) -> tuple[list[uuid.UUID], str | None]:
    """The message (``id``) or the cause (``reason``) an action names: exactly one."""
    reason = request.field("reason")
    text = request.field("id")
    if (text is None) == (reason is None):
        raise OutboxError("name one message (id) or one cause (reason)")
    return ([_message_id(text)] if text is not None else []), reason
