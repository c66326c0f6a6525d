"""`make demo`'s script, end to end, as the README's first command runs it: its own
PostgreSQL and Kafka, business transactions with outbox messages, the relay, the Spark
reconciliation and the inbox consumer, then the servers stopped.

It runs on a stack of its own (``--stack``), so a developer's `make demo` stack is left alone.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from outbox.devstack.stack import LocalStack, stack_home

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ORDERS = 120  # every tenth rolls back on purpose


def test_the_demo_relays_reconciles_and_bills_every_committed_order() -> None:
    name = f"pytest-demo-{os.getpid()}"
    output = stack_home() / f"{name}-reconciliation"
    command = [sys.executable, "examples/demo.py", "--orders", str(ORDERS), "--stack", name]
    stack = LocalStack.named(name)
    try:
        run = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
        )
        left_behind = stack.run_dir.exists()
    finally:
        stack.down()  # stopped already unless the demo was cut short
        shutil.rmtree(output, ignore_errors=True)
    report = run.stdout
    assert run.returncode == 0, report[-3000:] + run.stderr[-3000:]

    committed = ORDERS - ORDERS // 10
    assert f"({committed} committed, {ORDERS // 10} rolled back on purpose)" in report
    assert f"outbox rows            {{'sent': {committed}}}" in report
    assert f"outbox rows    {committed}\n  topic records  {committed}\n" in report
    # A class's limit is a number, or "-" (duplicates after an at-least-once relay).
    classes = dict(re.findall(r"^  (\w+) +(\d+) +(?:\d+|-)$", report, re.MULTILINE))
    assert set(classes) >= {"missing", "duplicate", "phantom", "stuck", "late"}, report
    assert set(classes.values()) == {"0"}, classes
    assert "verdict: PASS (0 discrepancies" in report
    assert f"first run              applied {committed}, skipped 0 duplicates" in report
    assert f"topic read again       applied 0, skipped {committed} duplicates" in report
    assert "ledger matches orders  yes" in report
    assert re.search(r"^  dashboard  http://127\.0\.0\.1:\d+/ ", report, re.MULTILINE), report
    assert "servers stopped" in report and not left_behind
