"""The database side of concurrent writes, measured with pgbench (no Python in the way).

Each transaction inserts one order row and one 190-byte message row, into one of three
tables of the outbox table's exact shape (columns, identity, indexes):

  shape     no wake-up at all: the most an outbox table could do
  outbox    the outbox table itself, with its wake trigger (no relay asleep: no NOTIFY)
  rule      the former design: a rule that NOTIFYs on every insert

Slots of each table rotate within rounds so that drift hits all alike.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import sqlalchemy as sa

from outbox.schema import OutboxTableSpec

TABLES = ("shape", "outbox", "rule")

_SCRIPT = """\\set shard random(0, 15)
BEGIN;
INSERT INTO orders VALUES (nextval('pgbench_order_ids'), 'cust-00001', 1999);
INSERT INTO {table} (id, shard, topic, key, value) VALUES (
  (lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000000)::bigint), 16, '0')
   || substr(md5(random()::text), 1, 16))::uuid,
  :shard, 'orders', '\\x637573742d3030303031'::bytea, '\\x{value}'::bytea);
COMMIT;
"""


def pgbench_path() -> str | None:
    found = shutil.which("pgbench")
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"))
    return str(candidates[-1]) if candidates else None


def prepare(engine: sa.Engine, spec: OutboxTableSpec) -> None:
    """Create the two comparison tables beside the outbox table, and the order id sequence."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE SEQUENCE IF NOT EXISTS pgbench_order_ids START 1000000000"))
        for name in ("outbox_shape", "outbox_rule"):
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
            conn.execute(sa.text(f"CREATE TABLE {name} (LIKE {spec.qualified_name} INCLUDING ALL)"))
        conn.execute(
            sa.text(
                "CREATE RULE outbox_rule_notify AS ON INSERT TO outbox_rule "
                "DO ALSO NOTIFY outbox_rule_channel"
            )
        )


def measure(
    database_url: str, clients: list[int], *, seconds: float, rounds: int
) -> dict[int, dict[str, dict[str, float]]]:
    """Per client count and table: tps and average latency (ms)."""
    binary = pgbench_path()
    if binary is None:
        raise RuntimeError("pgbench not found (Debian's postgresql package ships it)")
    url = sa.make_url(database_url)
    env = {**os.environ, "PGPASSWORD": url.password or ""}
    value = os.urandom(190).hex()
    results: dict[int, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        scripts = {}
        for table in TABLES:
            name = "outbox" if table == "outbox" else f"outbox_{table}"
            scripts[table] = Path(scratch, f"{table}.sql")
            scripts[table].write_text(_SCRIPT.format(table=name, value=value))
        for count in clients:
            totals = {
                table: {"transactions": 0.0, "seconds": 0.0, "latency": 0.0} for table in TABLES
            }
            for number in range(rounds):
                order = TABLES[number % len(TABLES) :] + TABLES[: number % len(TABLES)]
                for table in order:
                    tps, latency = _run(binary, env, url, scripts[table], count, seconds)
                    totals[table]["transactions"] += tps * seconds
                    totals[table]["seconds"] += seconds
                    totals[table]["latency"] += latency / rounds
            results[count] = {
                table: {
                    "tps": t["transactions"] / t["seconds"],
                    "latency_ms": t["latency"],
                }
                for table, t in totals.items()
            }
    return results


def _run(
    binary: str, env: dict[str, str], url: sa.URL, script: Path, clients: int, seconds: float
) -> tuple[float, float]:
    command = [
        binary,
        "-n",
        "-M",
        "prepared",
        "-c",
        str(clients),
        "-j",
        str(min(clients, 2)),
        "-T",
        str(max(1, round(seconds))),
        "-f",
        str(script),
        "-h",
        url.host or "127.0.0.1",
        "-p",
        str(url.port or 5432),
        "-U",
        url.username or "postgres",
        url.database or "postgres",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pgbench failed: {done.stderr.strip()[-500:]}")
    tps = re.search(r"tps = ([\d.]+)", done.stdout)
    latency = re.search(r"latency average = ([\d.]+) ms", done.stdout)
    if tps is None or latency is None:
        raise RuntimeError(f"pgbench printed no figures: {done.stdout[-500:]}")
    return float(tps.group(1)), float(latency.group(1))
