"""The local stack the benchmarks run on: started for the run and stopped after it."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator

from outbox.devstack import LocalStack, StackInfo


@contextlib.contextmanager
def bench_stack(name: str) -> Iterator[tuple[LocalStack, StackInfo]]:
    """A durable stack (PostgreSQL defaults: fsync on) of the benchmark's own."""
    stack = LocalStack.named(name, durable=True)
    try:
        info = stack.up(database="bench")
        yield stack, info
    finally:
        stack.down()


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cpus, Python {platform.python_version()}"


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, round(fraction * (len(sorted_values) - 1)))
    return sorted_values[index]
