"""The stack survives its own crashes: kill -9 of the servers or of their owner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psycopg
import pytest

from outbox.devstack import LocalStack
from outbox.devstack.procs import pid_alive
from outbox.devstack.stack import sweep_stale_runs

pytestmark = pytest.mark.integration


def _postmaster_pid(stack: LocalStack) -> int:
    return int((stack.postgres.data_dir / "postmaster.pid").read_text().split()[0])


def test_up_after_kill_9_restarts_on_the_same_ports_with_the_data_kept(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path / "run-a", durable=False)
    again = stack
    try:
        stack.up(database="app")
        with psycopg.connect(stack.postgres.conninfo("app"), autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (id int)")
        ports = (stack.postgres.port, stack.kafka.port)
        pids = (_postmaster_pid(stack), stack.kafka.pid)
        for pid in pids:
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        assert stack.kafka._process is not None
        stack.kafka._process.wait(10)  # reap our child, as a dead `outbox dev up` would not

        again = LocalStack(tmp_path / "run-a", durable=False)  # as a new `outbox dev up` would
        info = again.up(database="app")
        assert (again.postgres.port, again.kafka.port) == ports
        assert info.bootstrap_servers == f"127.0.0.1:{ports[1]}"
        with psycopg.connect(again.postgres.conninfo("app")) as conn:
            assert conn.execute("SELECT to_regclass('kept')").fetchone() == ("kept",)
        assert again.status() == {"postgres": True, "kafka": True}
    finally:
        again.down()
    assert not (tmp_path / "run-a").exists()


def test_sweep_stops_the_servers_of_a_run_whose_owner_died(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    stack = LocalStack(runs / "pytest-orphan", durable=False)
    stack.up_postgres()
    postmaster = _postmaster_pid(stack)
    dead_owner = subprocess.Popen(["true"])
    dead_owner.wait()
    state = json.loads(stack.state_file.read_text())
    state["owner_pid"] = dead_owner.pid
    stack.state_file.write_text(json.dumps(state))

    assert sweep_stale_runs("pytest-", runs_dir=runs) == ["pytest-orphan"]
    assert not pid_alive(postmaster)
    assert not (runs / "pytest-orphan").exists()
