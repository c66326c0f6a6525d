"""One trace from an HTTP request through the outbox: the FastAPI example (instrumented with
opentelemetry-instrumentation-fastapi) under a real uvicorn server, the relay's batch span
linked to the request, and a consumer span that continues the request's trace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import uvicorn
from opentelemetry import trace
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

import outbox
from examples.fastapi_service import app as service
from examples.fastapi_service import models as service_models
from outbox.devstack.procs import free_port
from outbox.devstack.topics import consume_messages
from outbox.tracing import extract_context
from tests.relay_helpers import message_id, relay_config, running_relay, statuses, wait_for
from tests.tracing_helpers import recorded_spans

pytestmark = pytest.mark.integration


@contextmanager
def serving_in_thread() -> Iterator[str]:
    """The instrumented example under uvicorn in this process, where its spans are recorded."""
    FastAPIInstrumentor.instrument_app(service.app)
    server = uvicorn.Server(
        uvicorn.Config(service.app, host="127.0.0.1", port=free_port(), log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "uvicorn did not stop"
        FastAPIInstrumentor.uninstrument_app(service.app)


def test_one_trace_from_the_request_to_the_relay_and_the_consumer(
    engine, outbox_url, bootstrap_servers, make_topic, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    spans = recorded_spans()
    topic = make_topic("traced")
    # The service's own tables (its Alembic history makes them in production).
    service_models.Base.metadata.create_all(engine)
    monkeypatch.setattr(service, "ob", outbox.Outbox(outbox_url))
    monkeypatch.setattr(service, "ORDERS_TOPIC", topic)
    with serving_in_thread() as base:
        customer = httpx.post(f"{base}/customers", json={"credit": "100.00"}, timeout=10)
        order = {
            "customer_id": customer.json()["customer_id"],
            "lines": [{"sku": "SKU-1", "quantity": 1, "unit_price": "9.90"}],
        }
        placed = httpx.post(f"{base}/orders", json=order, timeout=10)
        assert placed.status_code == 201, placed.text
    (request,) = [
        span
        for span in spans.get_finished_spans()
        if span.kind == trace.SpanKind.SERVER and span.name == "POST /orders"
    ]
    request_ids = (request.context.trace_id, request.context.span_id)

    # The outbox row carries the request's context ...
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT header_names, header_values FROM outbox")).one()
    names, values = row
    traceparent = dict(zip(names, values, strict=True))["traceparent"].decode()
    assert traceparent.split("-")[1:3] == [f"{request_ids[0]:032x}", f"{request_ids[1]:016x}"]

    # ... the relay's batch span, a trace of its own, links to it ...
    with running_relay(relay_config(outbox_url, bootstrap_servers)):
        wait_for(lambda: statuses(engine) == {"sent": 1}, 60, "the message sent")
    (batch,) = [span for span in spans.get_finished_spans() if span.name == f"send {topic}"]
    assert batch.kind == trace.SpanKind.PRODUCER
    assert batch.parent is None and batch.context.trace_id != request_ids[0]
    assert [(link.context.trace_id, link.context.span_id) for link in batch.links] == [request_ids]

    # ... and a consumer continues the request's trace from the record's headers.
    (record,) = consume_messages(bootstrap_servers, topic, expect=1)
    assert message_id(record) == uuid.UUID(placed.json()["message_id"])
    tracer = trace.get_tracer("billing")
    with tracer.start_as_current_span(
        "process order", context=extract_context(record), kind=trace.SpanKind.CONSUMER
    ) as consumer:
        pass
    assert consumer.get_span_context().trace_id == request_ids[0]
    (finished,) = [span for span in spans.get_finished_spans() if span.name == "process order"]
    assert finished.parent is not None
    assert (finished.parent.trace_id, finished.parent.span_id) == request_ids


def spans_in(text: str) -> list[dict[str, Any]]:
    """The spans OpenTelemetry's console exporter printed (JSON objects one after another)."""
    decoder = json.JSONDecoder()
    spans, position = [], 0
    while (start := text.find("{", position)) != -1:
        span, position = decoder.raw_decode(text, start)
        spans.append(span)
    return spans


def test_a_relay_run_under_opentelemetry_instrument_exports_its_batch_spans(
    engine, outbox_url, bootstrap_servers, make_topic, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """As docs/tracing.md runs it: the relay process sets up the SDK from OTEL_* variables."""
    recorded_spans()
    topic = make_topic("instrumented")
    with (
        trace.get_tracer("shop").start_as_current_span("place order") as request,
        outbox.Outbox(engine).transaction() as tx,
    ):
        tx.publish(topic, {"n": 1})
    bindir = Path(sys.executable).parent
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": outbox_url,
        "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
        "OTEL_SERVICE_NAME": "outbox-relay",
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
    }
    stdout, stderr = tmp_path / "spans.json", tmp_path / "relay.log"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(
            [str(bindir / "opentelemetry-instrument"), str(bindir / "outbox"), "relay",
             "--poll-interval", "0.2"],
            env=env, stdout=out, stderr=err,
        )  # fmt: skip
    try:
        wait_for(lambda: statuses(engine) == {"sent": 1}, 60, "the message sent")
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, stderr.read_text()
    # The batch span is exported when the relay's tracer provider shuts down, at exit.
    (batch,) = [span for span in spans_in(stdout.read_text()) if span["name"] == f"send {topic}"]
    assert batch["kind"] == "SpanKind.PRODUCER"
    assert batch["resource"]["attributes"]["service.name"] == "outbox-relay"
    context = request.get_span_context()
    links = [(link["context"]["trace_id"], link["context"]["span_id"]) for link in batch["links"]]
    assert links == [(f"0x{context.trace_id:032x}", f"0x{context.span_id:016x}")]
