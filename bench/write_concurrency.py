"""Concurrent writers for the write-path benchmark: throughput of each kind of transaction.

Writers are threads spread over a few processes (so that Python's own cost does not hide
the database's), each with its own connection. Every kind runs for a time slot with all
writers at once, kinds rotate within a round, and rounds repeat, so that drift on a noisy
machine hits all kinds alike.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

import sqlalchemy as sa

#: Threads per writer process at most; more writers start more processes.
THREADS_PER_PROCESS = 16


@dataclass
class SlotResult:
    transactions: int
    latencies_us: list[float]


RunnersFactory = Callable[[sa.Engine, int], dict[str, Callable[[sa.Connection, int], None]]]


def _run_slot(
    conn: sa.Connection,
    transaction: Callable[[sa.Connection, int], None],
    seconds: float,
    take_id: Callable[[], int],
) -> SlotResult:
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter_ns()
        with conn.begin():
            transaction(conn, take_id())
        latencies.append((time.perf_counter_ns() - start) / 1000)
    return SlotResult(len(latencies), latencies)


def _worker(
    commands: Connection,
    url: str,
    threads: int,
    first_id: int,
    payload_size: int,
    make_runners: RunnersFactory,
) -> None:
    engine = sa.create_engine(url, pool_size=threads, max_overflow=0)
    run = make_runners(engine, payload_size)
    conns = [engine.connect() for _ in range(threads)]
    ids = itertools.count(first_id)
    id_lock = threading.Lock()

    def take_id() -> int:
        with id_lock:
            return next(ids)

    with ThreadPoolExecutor(threads) as pool:
        while (command := commands.recv()) is not None:
            kind, seconds = command
            slots = [pool.submit(_run_slot, conn, run[kind], seconds, take_id) for conn in conns]
            results = [slot.result() for slot in slots]
            commands.send(
                SlotResult(
                    sum(r.transactions for r in results),
                    [latency for r in results for latency in r.latencies_us],
                )
            )
    for conn in conns:
        conn.close()
    engine.dispose()


def measure_concurrent(
    url: str,
    writers: int,
    kinds: tuple[str, ...],
    payload_size: int,
    make_runners: RunnersFactory,
    *,
    seconds: float,
    rounds: int,
    first_id: int,
) -> dict[str, tuple[float, list[float]]]:
    """Per kind: transactions per second and every transaction's latency in µs."""
    processes = max(1, -(-writers // THREADS_PER_PROCESS))
    shares = [
        writers // processes + (1 if i < writers % processes else 0) for i in range(processes)
    ]
    context = mp.get_context("spawn")
    pipes = []
    children = []
    for number, threads in enumerate(shares):
        ours, theirs = context.Pipe()
        child = context.Process(
            target=_worker,
            args=(theirs, url, threads, first_id + number * 10**9, payload_size, make_runners),
            daemon=True,
        )
        child.start()
        pipes.append(ours)
        children.append(child)
    totals = {kind: 0 for kind in kinds}
    elapsed = {kind: 0.0 for kind in kinds}
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
    try:
        for pipe in pipes:  # warm-up slot: connections, plans, caches
            pipe.send((kinds[-1], min(1.0, seconds)))
        for pipe in pipes:
            pipe.recv()
        for number in range(rounds):
            for kind in kinds[number % len(kinds) :] + kinds[: number % len(kinds)]:
                started = time.monotonic()
                for pipe in pipes:
                    pipe.send((kind, seconds))
                for pipe in pipes:
                    result: SlotResult = pipe.recv()
                    totals[kind] += result.transactions
                    latencies[kind].extend(result.latencies_us)
                elapsed[kind] += time.monotonic() - started
    finally:
        for pipe in pipes:
            pipe.send(None)
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    return {kind: (totals[kind] / elapsed[kind], sorted(latencies[kind])) for kind in kinds}
