"""A progress indication for long runs: the step in hand and Spark's task counts."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO


class Progress:
    """Prints ``[step] what`` lines, and while a step runs, its active stages every few seconds."""

    def __init__(self, spark_context: Any, out: TextIO = sys.stderr, every: float = 5.0) -> None:
        self._tracker = spark_context.statusTracker()
        self._out = out
        self._every = every
        self._started = time.monotonic()

    def _say(self, text: str) -> None:
        print(f"[{time.monotonic() - self._started:7.1f}s] {text}", file=self._out, flush=True)

    def _stages(self) -> str:
        parts = []
        for stage_id in sorted(self._tracker.getActiveStageIds()):
            info = self._tracker.getStageInfo(stage_id)
            if info is not None:
                parts.append(f"stage {stage_id} {info.numCompletedTasks}/{info.numTasks} tasks")
        return ", ".join(parts)

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Announce ``what``; report the active stages until it is done."""
        self._say(what)
        done = threading.Event()

        def report() -> None:
            while not done.wait(self._every):
                stages = self._stages()
                if stages:
                    self._say(f"  {stages}")

        reporter = threading.Thread(target=report, name="reconcile-progress", daemon=True)
        reporter.start()
        began = time.monotonic()
        try:
            yield
        finally:
            done.set()
            reporter.join()
            self._say(f"  done in {time.monotonic() - began:.1f}s")
