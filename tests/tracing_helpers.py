"""The OpenTelemetry SDK with an in-memory exporter, as the process's tracer provider.

OpenTelemetry lets a process set its global tracer provider once, so every test that records
spans shares this one and starts from an empty exporter.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_exporter: InMemorySpanExporter | None = None


def recorded_spans() -> InMemorySpanExporter:
    """The exporter every finished span of this process goes to, emptied."""
    global _exporter
    if _exporter is None:
        _exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_exporter))
        trace.set_tracer_provider(provider)
    _exporter.clear()
    return _exporter
