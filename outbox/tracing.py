"""Trace context through the outbox, with OpenTelemetry (the ``otel`` extra).

A message carries the trace of the request that published it: ``publish`` stores the current
context in the message's headers (W3C ``traceparent`` and ``tracestate``, written by
OpenTelemetry's global propagator, so also ``baggage`` where the application has some); the
relay's span for each batch links to those contexts (``relay/tracing.py``); a consumer
continues the trace with :func:`extract_context`.

No import, no cost without it. The outbox never imports OpenTelemetry to find out whether a
span is active: a span can only be active once the application has loaded the OpenTelemetry
API, so until ``opentelemetry.context`` is in ``sys.modules`` publishing costs one dictionary
look-up and adds nothing. After that, the propagator is imported once and asked on each
publish call; without an active span it writes no header. A header the caller passes
(``traceparent`` of its own, say) is kept as given.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.context import Context

#: The module every use of the OpenTelemetry API loads: present means "the application traces".
_OTEL_LOADED = "opentelemetry.context"

_propagate: ModuleType | None = None


def otel_loaded() -> bool:
    """Whether the application has loaded OpenTelemetry (then trace context is propagated)."""
    return _OTEL_LOADED in sys.modules


def _propagator() -> ModuleType | None:
    global _propagate
    if _propagate is None:
        if _OTEL_LOADED not in sys.modules:
            return None
        from opentelemetry import propagate

        _propagate = propagate
    return _propagate


def current_trace_headers() -> list[tuple[str, bytes]]:
    """The current trace context as Kafka headers; empty without OpenTelemetry or a span."""
    propagate = _propagator()
    if propagate is None:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [(name, value.encode()) for name, value in carrier.items()]


def headers_carrier(headers: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """Kafka headers as the text carrier OpenTelemetry's propagators read (last one wins)."""
    carrier: dict[str, str] = {}
    for name, value in headers or ():
        if isinstance(value, bytes):
            carrier[name] = value.decode("utf-8", "replace")
        elif isinstance(value, str):
            carrier[name] = value
    return carrier


def extract_context(record: Any) -> Context:
    """The trace context a Kafka record carries, to continue its trace in a consumer.

    ``record`` is a confluent-kafka ``Message`` (or a list of ``(name, bytes)`` headers). Pass
    the result as ``context=`` when starting the consumer's span::

        from opentelemetry import trace

        tracer = trace.get_tracer("billing")
        with tracer.start_as_current_span(
            "process orders", context=extract_context(record), kind=trace.SpanKind.CONSUMER
        ):
            handle(record)

    Needs the ``otel`` extra (``pip install "outbox-kafka[otel]"``).
    """
    try:
        from opentelemetry import propagate
    except ImportError as error:  # pragma: no cover - the extra is installed in development
        raise ImportError(
            'extract_context needs OpenTelemetry: pip install "outbox-kafka[otel]"'
        ) from error
    headers = record.headers() if callable(getattr(record, "headers", None)) else record
    return propagate.extract(headers_carrier(headers))


@contextmanager
def consumer_span(
    topic: str, headers: Iterable[tuple[str, Any]] | None, group: str
) -> Iterator[None]:
    """A CONSUMER span around one message's handler, continuing the trace its headers carry
    (the inbox runs every handler in one). Messages the handler publishes through the outbox
    carry this span's context on. Nothing without OpenTelemetry loaded."""
    propagate = _propagator()
    if propagate is None:
        yield
        return
    from opentelemetry import trace

    tracer = trace.get_tracer("outbox.inbox")
    with tracer.start_as_current_span(
        f"process {topic}",
        context=propagate.extract(headers_carrier(headers)),
        kind=trace.SpanKind.CONSUMER,
        attributes={
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.destination.name": topic,
            "messaging.consumer.group.name": group,
        },
    ):
        yield
