"""``outbox dashboard``: a small web page for operators, served by the project.

What ``outbox status``, ``outbox dead``, ``outbox inbox parked`` and ``outbox prepared`` show
and do, in a browser: an overview that refreshes itself, dead messages and parked inbox
messages grouped by cause with their retries, prepared messages with their commit and
rollback (with the rules of ``outbox prepared rollback``: through the checkers of
``--checker``, or on the operator's word that the step cannot happen), and a message
looked up by id. It reads and acts through the very functions those commands
call (:mod:`outbox.operator`, :mod:`outbox.inbox.parked`, :mod:`outbox.prepared.decisions`,
:mod:`outbox.status`).

Server-rendered HTML (Jinja2 templates, autoescaped) on the standard library's WSGI server:
no JavaScript at all, nothing to build. Read-only unless started with a token; see
docs/dashboard.md.
"""
