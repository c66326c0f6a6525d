"""Trace context in messages: written by publish when a span is active, read back by
consumers, linked by the relay's batch span; nothing at all without OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from opentelemetry import trace

from outbox.message import Message, encode_message
from outbox.records import OutboxRecord
from outbox.relay.tracing import batch_span, start_batch_span
from outbox.serialization import JsonSerializer
from outbox.tracing import consumer_span, current_trace_headers, extract_context
from tests.tracing_helpers import recorded_spans

tracer = trace.get_tracer("tests")


def test_without_opentelemetry_loaded_nothing_imports_it() -> None:
    code = """
import sys
import outbox, outbox.tracing, outbox.relay.daemon, outbox.relay.tracing
from outbox.message import Message, encode_message
from outbox.serialization import JsonSerializer

headers = outbox.tracing.current_trace_headers()
encoded = encode_message(Message("t", 1), JsonSerializer(), 1000, headers)
with outbox.relay.tracing.batch_span([]):
    pass
outbox.relay.tracing.start_batch_span([])()
loaded = sorted(name for name in sys.modules if name.startswith("opentelemetry"))
assert headers == [] and not loaded, loaded
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_no_trace_headers_outside_a_span() -> None:
    recorded_spans()
    assert current_trace_headers() == []


def test_publish_inside_a_span_stores_its_traceparent() -> None:
    recorded_spans()
    with tracer.start_as_current_span("request") as span:
        headers = dict(current_trace_headers())
    context = span.get_span_context()
    assert headers["traceparent"] == (
        f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}".encode()
    )


def test_headers_the_caller_sets_win_over_the_trace_context() -> None:
    recorded_spans()
    own = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracer.start_as_current_span("request"):
        trace_headers = current_trace_headers()
        encoded = encode_message(
            Message("t", 1, headers={"traceparent": own, "x": "y"}),
            JsonSerializer(),
            1000,
            trace_headers,
        )
    assert encoded.row["header_names"] == ["traceparent", "x"]
    assert encoded.row["header_values"] == [own, b"y"]


def ids(context: trace.SpanContext | None) -> tuple[int, int]:
    """A span's identity (what a context read back from headers shares with the original)."""
    assert context is not None
    return context.trace_id, context.span_id


def record_with(headers: list[tuple[str, bytes | None]]) -> OutboxRecord:
    return OutboxRecord(uuid.uuid4(), 1, 0, "orders", None, b"{}", headers)


def test_a_consumer_continues_the_trace_from_the_headers() -> None:
    spans = recorded_spans()
    with tracer.start_as_current_span("request") as request:
        headers = current_trace_headers()
    with tracer.start_as_current_span("consume", context=extract_context(headers)) as consume:
        pass
    assert consume.get_span_context().trace_id == request.get_span_context().trace_id
    finished = {span.name: span for span in spans.get_finished_spans()}
    assert ids(finished["consume"].parent) == ids(request.get_span_context())


def test_an_inbox_handler_runs_in_a_span_that_continues_the_trace_and_passes_it_on() -> None:
    spans = recorded_spans()
    with tracer.start_as_current_span("request") as request:
        headers = current_trace_headers()
    with consumer_span("orders", headers, "billing"):
        published = dict(current_trace_headers())  # what the handler's own publish would carry
    (handler,) = [s for s in spans.get_finished_spans() if s.name == "process orders"]
    assert handler.kind == trace.SpanKind.CONSUMER
    assert ids(handler.parent) == ids(request.get_span_context())
    assert handler.attributes is not None
    assert handler.attributes["messaging.consumer.group.name"] == "billing"
    trace_id = request.get_span_context().trace_id
    assert published["traceparent"].split(b"-")[1] == f"{trace_id:032x}".encode()
    assert published["traceparent"].split(b"-")[2] == f"{handler.context.span_id:016x}".encode()


def test_the_batch_span_is_a_root_linked_to_each_message_with_a_context() -> None:
    spans = recorded_spans()
    contexts = []
    for _ in range(2):
        with tracer.start_as_current_span("request") as request:
            contexts.append((request.get_span_context(), current_trace_headers()))
    records = [record_with(headers) for _, headers in contexts] + [record_with([])]
    with tracer.start_as_current_span("unrelated"), batch_span(records):
        pass
    (batch,) = [span for span in spans.get_finished_spans() if span.name == "send orders"]
    assert batch.parent is None
    assert batch.kind == trace.SpanKind.PRODUCER
    assert [ids(link.context) for link in batch.links] == [ids(c) for c, _ in contexts]
    assert batch.attributes is not None
    assert batch.attributes["messaging.batch.message_count"] == 3
    assert batch.attributes["messaging.destination.name"] == "orders"


def test_the_batch_span_links_each_context_once_and_no_more_than_a_span_keeps(
    monkeypatch,
) -> None:  # type: ignore[no-untyped-def]
    spans = recorded_spans()
    monkeypatch.setenv("OTEL_SPAN_LINK_COUNT_LIMIT", "3")
    with tracer.start_as_current_span("one request"):
        same = current_trace_headers()
    others = []
    for _ in range(5):
        with tracer.start_as_current_span("request"):
            others.append(current_trace_headers())
    records = [record_with(same), record_with(same)] + [record_with(h) for h in others]
    with batch_span(records):
        pass
    (batch,) = [span for span in spans.get_finished_spans() if span.name == "send orders"]
    assert len(batch.links) == 3
    assert len({ids(link.context) for link in batch.links}) == 3


def test_a_batch_span_started_in_one_step_ends_in_another() -> None:
    spans = recorded_spans()
    with tracer.start_as_current_span("request") as request:
        headers = current_trace_headers()
    end = start_batch_span([record_with(headers)])
    assert not [span for span in spans.get_finished_spans() if span.name == "send orders"]
    end()
    (batch,) = [span for span in spans.get_finished_spans() if span.name == "send orders"]
    assert batch.parent is None
    assert [ids(link.context) for link in batch.links] == [ids(request.get_span_context())]


def test_an_error_while_publishing_ends_the_batch_span_with_its_status() -> None:
    spans = recorded_spans()
    with pytest.raises(RuntimeError), batch_span([record_with([])]):
        raise RuntimeError("broker gone")
    (batch,) = [span for span in spans.get_finished_spans() if span.name == "send orders"]
    assert batch.status.status_code == trace.StatusCode.ERROR
    assert [event.name for event in batch.events] == ["exception"]
