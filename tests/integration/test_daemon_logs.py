"""Kafka down under a running relay and a running consumer: a few lines every 10 seconds from
each, in the daemons' one format (JSON lines, librdkafka's lines among them), not hundreds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outbox.chaos.proxy import FaultProxy
from tests.inbox_helpers import prepare_database, start_consumer_process
from tests.relay_helpers import start_relay_process, stop_process, wait_for

pytestmark = pytest.mark.integration

OUTAGE = 30.0
WINDOW = 10.0
#: Lines a daemon may write in a window of the outage: each cause (a broker connection
#: failing, all brokers down, the loop's own retry) once, plus its count a window later.
#: Unfolded, librdkafka alone wrote hundreds.
MOST_PER_WINDOW = 10


OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def documented_signal_line(daemon: str) -> str:
    """The SIGTERM line docs/operations.md quotes for ``daemon`` (relay, consumer, checkback)."""
    command = {"relay": "relay", "consumer": "consume", "checkback": "checkback"}[daemon]
    for line in OPERATIONS.read_text().splitlines():
        if line.startswith(f"| `outbox {command}` | `"):
            return line.split("`")[3]
    raise AssertionError(f"docs/operations.md quotes no SIGTERM line of outbox {command}")


def lines_of(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines()


def test_kafka_down_for_30s_gives_a_few_lines_per_10s(
    outbox_url: str, faulty_kafka: FaultProxy, make_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    bootstrap = f"127.0.0.1:{faulty_kafka.listen_port}"
    topic = make_topic("logs")
    prepare_database(outbox_url).dispose()
    logs = {"relay": tmp_path / "relay.log", "consumer": tmp_path / "consumer.log"}
    relay = start_relay_process(outbox_url, bootstrap, log=logs["relay"])
    consumer = start_consumer_process(
        outbox_url, bootstrap, [topic], "logs-test", log=logs["consumer"]
    )
    try:
        time.sleep(2)  # the start-up lines are written
        windows: dict[str, list[int]] = {name: [] for name in logs}
        faulty_kafka.drop()
        marks = {name: len(lines_of(log)) for name, log in logs.items()}
        outage_end = time.monotonic() + OUTAGE
        while time.monotonic() < outage_end:
            time.sleep(min(WINDOW, outage_end - time.monotonic()))
            for name, log in logs.items():
                count = len(lines_of(log))
                windows[name].append(count - marks[name])
                marks[name] = count
        faulty_kafka.heal()
        print(f"lines per {WINDOW:.0f}s with Kafka down: {windows}")  # shown with -s
        for name, counts in windows.items():
            assert counts and max(counts) <= MOST_PER_WINDOW, (name, counts, lines_of(logs[name]))
            assert sum(counts) > 0, f"the {name} said nothing about the outage"
        wait_for(relay.ready, 60, "the relay to be ready again")
    finally:
        faulty_kafka.heal()
        codes = {"relay": stop_process(relay), "consumer": stop_process(consumer)}
    assert codes == {"relay": 0, "consumer": 0}
    for name, log in logs.items():
        entries = [json.loads(line) for line in lines_of(log)]  # every line is JSON
        assert any(entry["logger"] == "outbox.kafka" for entry in entries), name
        # Every daemon says it got the signal, and what it does: the line operations.md quotes.
        said = [entry["msg"] for entry in entries if entry["level"] == "info"]
        assert documented_signal_line(name) in said, (name, said)


def test_the_check_back_runner_logs_in_the_same_format_and_logs_its_signal(
    outbox_url: str, tmp_path: Path
) -> None:
    from outbox.devstack.procs import free_port
    from tests.relay_helpers import STARTED, RelayProcess

    log = tmp_path / "checkback.log"
    port = free_port()
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": outbox_url,
        "ORDERS_DATABASE_URL": outbox_url,
        "OUTBOX_CHECKBACK_METRICS_PORT": str(port),
        "OUTBOX_LOG_FORMAT": "text",
    }
    with log.open("ab") as output:
        process = RelayProcess(
            [sys.executable, "-m", "outbox.cli", "checkback", "tests.prepared_app:registry"],
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    process.metrics_port = port
    STARTED.append(process)
    process.wait_ready()
    assert stop_process(process, signal.SIGINT) == 0
    text = lines_of(log)
    said = [line for line in text if "SIGINT received" in line]
    assert said and " INFO " in said[0] and "outbox.checkback: " in said[0], text
    quoted = documented_signal_line("checkback").replace("SIGTERM", "SIGINT")
    assert said[0].endswith(quoted), (said[0], quoted)
    assert not any(line.startswith("{") for line in text), text  # text, as asked
