"""A span per published batch, linked to the traces of its messages (OpenTelemetry).

A batch holds messages of many requests, each with a trace of its own, so the batch's span
cannot be a child of all of them: it starts a trace of its own and carries a *link* to each
message's context (the ``traceparent`` that ``publish`` stored in the message's headers), as
OpenTelemetry's messaging conventions do for batches. A trace viewer goes from a request to
the batch that sent its message, and from the batch to every request in it.

Without OpenTelemetry loaded in the relay's process (see ``outbox/tracing.py``), the context
manager does nothing and imports nothing. Run the relay under ``opentelemetry-instrument``
(or set up a tracer provider before it starts) to export the spans.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from outbox.records import OutboxRecord
from outbox.tracing import headers_carrier, otel_loaded

if TYPE_CHECKING:
    from opentelemetry.trace import Span

TRACER_NAME = "outbox.relay"


def _link_limit() -> int:
    """How many links a span keeps: the SDK's limit (OTEL_SPAN_LINK_COUNT_LIMIT or its
    default). Without the SDK spans record nothing, links neither."""
    try:
        from opentelemetry.sdk.trace import SpanLimits
    except ImportError:
        return 0
    return SpanLimits().max_links or 0


@contextmanager
def batch_span(records: Sequence[OutboxRecord]) -> Iterator[None]:
    """A PRODUCER span around publishing ``records``, linked to their publishers' contexts.

    An exception from the block ends the span with an error status and propagates.
    """
    if not otel_loaded():
        yield
        return
    from opentelemetry import trace

    with trace.use_span(_start_span(records), end_on_exit=True):
        yield


def start_batch_span(records: Sequence[OutboxRecord]) -> Callable[[], None]:
    """Start the span of a batch whose publishing ends elsewhere; returns what ends it.

    For a loop that hands a batch to the producer in one step and records its outcome in
    another: call the returned function when the batch settled. Without OpenTelemetry it does
    nothing.
    """
    if not otel_loaded():
        return _nothing
    return _start_span(records).end


def _nothing() -> None:
    return None


def _start_span(records: Sequence[OutboxRecord]) -> Span:
    from opentelemetry import propagate, trace

    # Only the headers the propagator reads, each context once (a batch often holds several
    # messages of one request), and no more links than a span keeps: reading contexts is most
    # of this function's cost.
    fields = propagate.get_global_textmap().fields
    limit = _link_limit()
    seen: set[tuple[tuple[str, str], ...]] = set()
    links: list[trace.Link] = []
    for record in records:
        if len(links) >= limit:
            break
        carrier = headers_carrier(pair for pair in record.headers if pair[0] in fields)
        key = tuple(sorted(carrier.items()))
        if not carrier or key in seen:
            continue
        seen.add(key)
        span_context = trace.get_current_span(propagate.extract(carrier)).get_span_context()
        if span_context.is_valid:
            links.append(trace.Link(span_context))
    topics = sorted({record.topic for record in records})
    attributes: dict[str, str | int] = {
        "messaging.system": "kafka",
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.batch.message_count": len(records),
    }
    if len(topics) == 1:
        attributes["messaging.destination.name"] = topics[0]
    name = f"send {topics[0]}" if len(topics) == 1 else "send"
    # A root span: the relay's loop has no trace of its own to continue.
    return trace.get_tracer(TRACER_NAME).start_span(
        name,
        context=trace.set_span_in_context(trace.INVALID_SPAN),
        kind=trace.SpanKind.PRODUCER,
        links=links,
        attributes=attributes,
    )
