"""The daemons' one log set-up: JSON or text, secrets masked, repeated errors folded."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator

import pytest

from outbox.logs import (
    FoldingHandler,
    JsonFormatter,
    TextFormatter,
    configure_logging,
    configured_handler,
    log_fatal,
)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)


def folding(interval: float = 0.3) -> tuple[logging.Logger, io.StringIO, FoldingHandler]:
    out = io.StringIO()
    handler = FoldingHandler(out, interval)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(f"test.folding.{time.monotonic_ns()}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, out, handler


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_burst_of_one_error_is_one_line_then_one_line_with_its_count() -> None:
    logger, out, handler = folding()
    for attempt in range(500):
        # What librdkafka repeats while a broker is down: only numbers change.
        logger.error(
            "FAIL [rdkafka#producer-1] Connect failed (after %dms in state CONNECT)", attempt
        )
    assert len(lines(out)) == 1
    time.sleep(0.3 * 4)  # the sweeper writes the count once the interval ended
    written = lines(out)
    assert len(written) == 2, written
    assert written[1]["repeated"] == 499
    assert "after 499ms" in str(written[1]["msg"])  # the last one stands for them
    handler.close()


def test_each_cause_gets_its_own_line_and_info_lines_are_never_folded() -> None:
    logger, out, handler = folding(interval=60)
    for _ in range(3):
        logger.error("Kafka error: broker down")
        logger.warning("database unreachable", extra={"error": "connection refused"})
        logger.warning("database unreachable", extra={"error": "password authentication"})
        logger.info("shards taken over")
    messages = [(entry["msg"], entry.get("error")) for entry in lines(out)]
    assert messages == [
        ("Kafka error: broker down", None),
        ("database unreachable", "connection refused"),
        ("database unreachable", "password authentication"),
        ("shards taken over", None),
        ("shards taken over", None),
        ("shards taken over", None),
    ]
    handler.close()  # closing writes what was folded
    counts = [entry.get("repeated") for entry in lines(out)[6:]]
    assert counts == [2, 2, 2]


def test_a_cause_that_keeps_repeating_gets_one_line_an_interval() -> None:
    logger, out, handler = folding(interval=0.5)
    end = time.monotonic() + 2.6
    while time.monotonic() < end:
        logger.error("Connection refused")
        time.sleep(0.001)
    handler.close()
    # 2.6 s at 0.5 s an interval: the first line, then about one an interval (the sweeper
    # wakes every 0.125 s, so an interval may end a little late). Unfolded: over a thousand.
    assert 3 <= len(lines(out)) <= 8, len(lines(out))


def test_the_format_follows_the_terminal_unless_named(restore_root_logger: None) -> None:
    terminal, pipe = Terminal(), io.StringIO()
    configure_logging("INFO", stream=terminal)
    logging.getLogger("outbox.test").info("to a person", extra={"shard": 3})
    configure_logging("INFO", stream=pipe)
    logging.getLogger("outbox.test").info("to a collector")
    configure_logging("INFO", "json", stream=terminal)
    logging.getLogger("outbox.test").info("json asked for")
    text_line, json_asked = terminal.getvalue().splitlines()
    assert "INFO" in text_line and "outbox.test: to a person" in text_line
    assert "shard=3" in text_line and not text_line.startswith("{")
    assert json.loads(pipe.getvalue())["msg"] == "to a collector"
    assert json.loads(json_asked)["msg"] == "json asked for"
    with pytest.raises(ValueError, match="log format"):
        configure_logging("INFO", "xml", stream=pipe)


def test_both_formats_mask_secrets() -> None:
    record = logging.makeLogRecord(
        {"msg": "connecting to postgresql+psycopg://app:hunter2@db/shop", "levelno": 20}
    )
    for formatter in (JsonFormatter(), TextFormatter()):
        line = formatter.format(record)
        assert "hunter2" not in line and "app:***@db" in line


def test_every_line_of_librdkafka_is_folded_whatever_its_level() -> None:
    from outbox.logs import KAFKA_LOGGER

    out = io.StringIO()
    handler = FoldingHandler(out, 60)
    handler.setFormatter(JsonFormatter())
    for _ in range(50):
        # librdkafka reports a lost broker connection as information, once a second.
        record = KAFKA_LOGGER.makeRecord(
            KAFKA_LOGGER.name,
            logging.INFO,
            __file__,
            1,
            "FAIL [rdkafka#producer-1] 127.0.0.1:9092/1: Disconnected (after %dms)",
            (3,),
            None,
        )
        handler.handle(record)
    handler.close()
    assert [entry.get("repeated") for entry in lines(out)] == [None, 49]


def test_the_fatal_line_is_json_and_last_with_the_folded_repeats_before_it(
    restore_root_logger: None,
) -> None:
    pipe = io.StringIO()
    configure_logging("INFO", "json", stream=pipe, fold_seconds=60)
    log = logging.getLogger("outbox.test")
    for pause in (0.5, 1.0, 2.0):
        log.warning("database not ready; trying again in %.1fs", pause)
    assert log_fatal(configured_handler(), "database error: connection refused", 2)
    log.warning("a thread that still talks")
    _, repeats, fatal = lines(pipe)
    assert repeats["repeated"] == 2
    assert fatal == {**fatal, "level": "critical", "msg": "database error: connection refused"}
    assert fatal["exit_code"] == 2


def test_in_text_the_caller_writes_the_fatal_line_after_the_folded_repeats(
    restore_root_logger: None,
) -> None:
    pipe = io.StringIO()
    configure_logging("INFO", "text", stream=pipe, fold_seconds=60)
    log = logging.getLogger("outbox.test")
    for _ in range(3):
        log.warning("database not ready")
    assert not log_fatal(configured_handler(), "database error: refused", 2)  # click prints it
    log.warning("a thread that still talks")
    _, repeats = pipe.getvalue().splitlines()
    assert "repeated=2" in repeats
