"""The outcome recorder's tries again: an outcome recorded in part (rows another transaction
holds locked) stays being recorded, aging from its first submission, and is tried again when
due without the loop waiting for it."""

from __future__ import annotations

import time

from outbox.relay.recording import OutcomeRecorder


def test_an_outcome_recorded_in_part_is_tried_again_when_due_and_keeps_its_age() -> None:
    tries: list[float] = []

    def record() -> float | None:
        tries.append(time.monotonic())
        return 0.2 if len(tries) < 3 else None  # held twice, then recorded

    recorder: OutcomeRecorder[str] = OutcomeRecorder(workers=1)
    try:
        recorder.submit("batch", record)
        submitted = recorder.oldest_submitted()
        recorder.wait(5)
        assert list(recorder.collect(block=True)) == []  # tried once: not recorded yet
        assert recorder.retrying() == ["batch"] and recorder.running == 0
        began = time.monotonic()
        assert list(recorder.collect(block=True)) == []  # not due: neither run nor waited for
        assert time.monotonic() - began < 0.1 and len(tries) == 1
        collected: list[str] = []
        deadline = time.monotonic() + 10
        while not collected and time.monotonic() < deadline:
            recorder.wait(1)
            collected = list(recorder.collect(block=False))
            assert recorder.oldest_submitted() in (submitted, None)
        assert collected == ["batch"] and len(tries) == 3 and len(recorder) == 0
        assert tries[1] - tries[0] >= 0.2 and tries[2] - tries[1] >= 0.2
    finally:
        recorder.close()
