"""WAL-mode probes: what the write shape costs the writers, and what decoding costs a reader.

On a private, durable PostgreSQL 15 cluster with ``wal_level = logical``, in one run:

a. Writers (pgbench, 16 and 64 clients): a transaction writes an order row plus

     base      nothing else (the reference the WAL bytes of a message are counted from)
     emit      pg_logical_emit_message(true, 'outbox', <the message framed as bytes>)
     row       an outbox row, the publish path's INSERT, into the real outbox table
     both      the row and the emitted message

   tps of each, and the WAL bytes per message (WAL per transaction less base's).

b. Decoding, bytes in and messages out, on its own: ``--messages`` transactions of one
   message each are written first (with no reader), then read into Python and decoded into
   the fields a relay sends (id, topic, key, value, headers, ...), each way from its own slot:

     emit/sql        pgoutput ('messages'), pg_logical_slot_peek_binary_changes in chunks
                     (each chunk confirmed with pg_replication_slot_advance)
     emit/stream     pgoutput over the replication protocol, psycopg 3's libpq binding
     emit/psycopg2   pgoutput over psycopg2's LogicalReplicationConnection
     row/sql, row/stream, row/psycopg2   the same for outbox rows, through the WAL
                     source's own publication (outbox.wal.slots: the table's inserts of
                     pending rows, ten columns, binary values)
     row/reader      row/stream through the WAL source's reader (outbox.wal.WalReader:
                     its bookkeeping, commit confirmed after each read); unlike the bare
                     streams, which drop each transaction's messages at its commit, it keeps
                     a read's items, as a relay keeps a batch until Kafka answered
     row/reader-nogc row/reader with Python's cyclic garbage collector off while reading
                     (what a relay could win by freezing or tuning it)
     row/stream-nofilter   row/stream through a publication without the row filter on status
     row/wal2json-sql, row/wal2json-stream   wal2json (format 2) of the rows, parsed with
                     orjson (wal2json sends every column of the table, as text)

   msgs/s (wall), and the CPU seconds per 100,000 messages of the Python client
   (time.process_time) and of the server's backend doing the decoding (/proc).

Each probe runs ``--repeats`` times, interleaved in rounds (the machine is shared and noisy:
compare within a round); every run is printed, then the medians and the ratios.
Run: make bench-wal-probe   (or python -m bench.wal_probe --messages 200000)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import secrets
import select
import shutil
import statistics
import struct
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg.conninfo import conninfo_to_dict

from bench.stack import machine
from bench.write_pgbench import pgbench_path
from outbox import migrate
from outbox.devstack.postgres import PostgresServer
from outbox.devstack.procs import free_port
from outbox.schema import DEFAULT_SPEC
from outbox.wal.lsn import format_lsn
from outbox.wal.pgoutput import (
    PUBLISHED_COLUMNS,
    Begin,
    Commit,
    LogicalMessage,
    PgOutputDecoder,
    WalMessage,
)
from outbox.wal.reader import WalReader
from outbox.wal.slots import ensure_publication, slot_name
from outbox.wal.stream import XLOG_DATA, XLOG_HEADER, ReplicationStream

WRITE_SHAPES = ("base", "emit", "row", "both")
DECODERS = (
    "emit/sql",
    "emit/stream",
    "emit/psycopg2",
    "row/sql",
    "row/stream",
    "row/reader",
    "row/reader-nogc",
    "row/psycopg2",
    "row/stream-nofilter",
    "row/wal2json-sql",
    "row/wal2json-stream",
)
VALUE = os.urandom(190)
KEY = b"cust-00001"
TOPIC = "orders"

# The message as an emitted frame: id, shard, created_at (µs), topic, key, value lengths,
# then the three; a relay would decode this from pg_logical_emit_message's content.
_FRAME = struct.Struct(">16shqHii")


def frame(message_id: bytes) -> bytes:
    head = _FRAME.pack(message_id, 3, 0, len(TOPIC), len(KEY), len(VALUE))
    return head + TOPIC.encode() + KEY + VALUE


_ID_SQL = (
    "(lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000000)::bigint), 16, '0')"
    " || substr(md5(random()::text), 1, 16))::uuid"
)
_ORDER_SQL = "INSERT INTO orders VALUES (nextval('order_ids'), 'cust-00001', 1999);"
# The publish path's INSERT (outbox.publisher: the columns a plain message sets).
_ROW_SQL = (
    f"INSERT INTO outbox (id, shard, topic, key, value) VALUES ({_ID_SQL}, :shard, "
    f"'{TOPIC}', '\\x{KEY.hex()}'::bytea, '\\x{VALUE.hex()}'::bytea);"
)
_EMIT_SQL = "SELECT pg_logical_emit_message(true, 'outbox', '\\x{frame}'::bytea);"


def _script(shape: str) -> str:
    lines = ["\\set shard random(0, 15)", "BEGIN;", _ORDER_SQL]
    if shape in ("row", "both"):
        lines.append(_ROW_SQL)
    if shape in ("emit", "both"):
        lines.append(_EMIT_SQL.format(frame=frame(uuid.uuid4().bytes).hex()))
    lines.append("COMMIT;")
    return "\n".join(lines) + "\n"


class ProbeServer(PostgresServer):
    """The local stack's cluster, with room for a slot per decoder and repeat."""

    def _settings(self) -> str:
        return super()._settings() + "max_replication_slots = 40\nmax_wal_senders = 40\n"


# -- a. writers ------------------------------------------------------------------------------


def measure_writes(
    server: PostgresServer, database: str, clients: list[int], seconds: int, repeats: int
) -> tuple[dict[int, list[dict[str, float]]], dict[str, float]]:
    """Per client count, one dict per round: shape -> tps; and the WAL bytes per transaction
    of each shape."""
    binary = pgbench_path()
    if binary is None:
        raise SystemExit("pgbench not found (Debian's postgresql package ships it)")
    env = {**os.environ, "PGPASSWORD": server.password}
    results: dict[int, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        scripts = {}
        for shape in WRITE_SHAPES:
            scripts[shape] = Path(scratch, f"{shape}.sql")
            scripts[shape].write_text(_script(shape))
        wal = _wal_per_transaction(binary, env, server, database, scripts)
        for count in clients:
            results[count] = []
            for number in range(repeats):
                shift = number % len(WRITE_SHAPES)
                order = WRITE_SHAPES[shift:] + WRITE_SHAPES[:shift]
                round_: dict[str, float] = {}
                for shape in order:
                    run = ["-c", str(count), "-j", "2", "-T", str(seconds)]
                    output = _pgbench(binary, env, server, database, scripts[shape], run)
                    round_[shape] = _figure(r"tps = ([\d.]+)", output)
                results[count].append(round_)
                line = ", ".join(f"{s} {round_[s]:,.0f} tps" for s in WRITE_SHAPES)
                print(f"  writers {count:>2} round {number + 1}: {line}")
    return results, wal


def _wal_per_transaction(
    binary: str,
    env: dict[str, str],
    server: PostgresServer,
    database: str,
    scripts: dict[str, Path],
) -> dict[str, float]:
    """WAL bytes per transaction of each shape, without full-page images (they come after
    each checkpoint whatever the shape, and would make the figure depend on the timing)."""
    transactions = 4 * 2_000
    wal: dict[str, float] = {}
    with psycopg.connect(server.conninfo(database), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET full_page_writes = off")
        conn.execute("SELECT pg_reload_conf()")
        try:
            for shape in WRITE_SHAPES:
                before = _current_lsn(conn)
                _pgbench(binary, env, server, database, scripts[shape], ["-c", "4", "-t", "2000"])
                wal[shape] = (_current_lsn(conn) - before) / transactions
        finally:
            conn.execute("ALTER SYSTEM RESET full_page_writes")
            conn.execute("SELECT pg_reload_conf()")
    return wal


def _pgbench(
    binary: str,
    env: dict[str, str],
    server: PostgresServer,
    database: str,
    script: Path,
    run: list[str],
) -> str:
    with psycopg.connect(server.conninfo(database), autocommit=True) as conn:
        conn.execute("CHECKPOINT")  # each run starts with the same full-page-write state
    command = [binary, "-n", "-M", "prepared", *run, "-f", str(script)]
    command += ["-h", "127.0.0.1", "-p", str(server.port), "-U", "postgres", database]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"pgbench failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def _figure(pattern: str, output: str) -> float:
    found = re.search(pattern, output)
    if found is None:
        raise SystemExit(f"pgbench printed no figures: {output[-500:]}")
    return float(found.group(1))


def _current_lsn(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint").fetchone()
    assert row is not None
    return int(row[0])


# -- b. decoding -----------------------------------------------------------------------------


def prepare_decoding(server: PostgresServer, database: str, messages: int, repeats: int) -> None:
    """Slots for every decoder and repeat, then ``messages`` transactions of each shape."""
    with psycopg.connect(server.conninfo(database), autocommit=True) as conn:
        ensure_publication(conn, DEFAULT_SPEC)
        conn.execute(
            "CREATE PUBLICATION probe_nofilter FOR TABLE public.outbox"
            f" ({', '.join(PUBLISHED_COLUMNS)}) WITH (publish = 'insert')"
        )
        conn.execute("CREATE PUBLICATION probe_none")  # no table: logical messages only
        for shape, procedure in (("emit", _EMIT_PROCEDURE), ("row", _ROW_PROCEDURE)):
            for decoder in DECODERS:
                if not decoder.startswith(shape):
                    continue
                plugin = "wal2json" if "wal2json" in decoder else "pgoutput"
                for repeat in range(repeats):
                    conn.execute(
                        "SELECT pg_create_logical_replication_slot(%s, %s)",
                        (_slot(decoder, repeat), plugin),
                    )
            conn.execute(procedure.format(frame=frame(uuid.uuid4().bytes).hex(), value=VALUE.hex()))
            started = time.monotonic()
            conn.execute("SET synchronous_commit = off")
            conn.execute(f"CALL probe_write_{shape}(%s)", (messages,))
            conn.execute("RESET synchronous_commit")
            took = time.monotonic() - started
            print(f"  wrote {messages:,} transactions ({shape}) in {took:.1f}s")


_EMIT_PROCEDURE = """
CREATE PROCEDURE probe_write_emit(n int) LANGUAGE plpgsql AS $$
BEGIN
  FOR i IN 1..n LOOP
    INSERT INTO orders VALUES (nextval('order_ids'), 'cust-00001', 1999);
    PERFORM pg_logical_emit_message(true, 'outbox', '\\x{frame}'::bytea);
    COMMIT;
  END LOOP;
END $$"""

_ROW_PROCEDURE = (
    """
CREATE PROCEDURE probe_write_row(n int) LANGUAGE plpgsql AS $$
BEGIN
  FOR i IN 1..n LOOP
    INSERT INTO orders VALUES (nextval('order_ids'), 'cust-00001', 1999);
    INSERT INTO outbox (id, shard, topic, key, value) VALUES ("""
    + _ID_SQL
    + """, i % 16, 'orders', '\\x"""
    + KEY.hex()
    + """'::bytea, '\\x{value}'::bytea);
    COMMIT;
  END LOOP;
END $$"""
)


def _slot(decoder: str, repeat: int) -> str:
    return "probe_" + re.sub(r"[^a-z0-9]", "_", decoder) + f"_{repeat}"


def _pgoutput_options(shape: str, publication: str | None = None) -> dict[str, str]:
    publication = publication or ("probe_none" if shape == "emit" else slot_name(DEFAULT_SPEC))
    options = {"proto_version": "1", "publication_names": publication, "binary": "true"}
    if shape == "emit":
        options["messages"] = "true"
    return options


_WAL2JSON_OPTIONS = {
    "format-version": "2",
    "add-tables": "public.outbox",
    "include-transaction": "true",
    "include-lsn": "true",
}


class Count:
    """What one decoder produced: messages (checked against what was written)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.messages = 0
        self.last_end = 0

    @property
    def done(self) -> bool:
        return self.messages >= self.target


def decode_emitted(message: LogicalMessage, commit_lsn: int) -> WalMessage:
    """An emitted frame (see ``frame``) into the same fields an outbox row gives."""
    content = message.content
    (message_id, shard, created, topic_size, key_size, value_size) = _FRAME.unpack_from(content)
    pos = _FRAME.size
    topic = content[pos : pos + topic_size].decode()
    pos += topic_size
    key = content[pos : pos + key_size] if key_size >= 0 else None
    pos += max(key_size, 0)
    value = content[pos : pos + value_size] if value_size >= 0 else None
    return WalMessage(
        uuid.UUID(bytes=message_id),
        0,
        shard,
        topic,
        key,
        value,
        None,
        None,
        None,
        created / 1e6,
        message.lsn,
        commit_lsn,
    )


class Consumer:
    """Turns raw pgoutput messages into outbox messages, for either shape."""

    def __init__(self, shape: str, count: Count) -> None:
        self.shape = shape
        self.count = count
        self.decoder = PgOutputDecoder(("public", "outbox"), frozenset({"outbox"}))
        self.out: list[WalMessage] = []
        self.commit_lsn = 0

    def feed(self, data: bytes, offset: int, lsn: int) -> None:
        item = self.decoder.decode(data, offset, lsn)
        if item is None:
            return
        if isinstance(item, WalMessage):
            self.out.append(item)
        elif isinstance(item, LogicalMessage):
            self.out.append(decode_emitted(item, self.commit_lsn))
        elif isinstance(item, Begin):
            self.commit_lsn = item.commit_lsn
        else:
            self.count.last_end = item.end_lsn
            self.count.messages += len(self.out)
            self.out.clear()  # a relay would hand the transaction on here


def run_sql(conninfo: str, slot: str, shape: str, count: Count, chunk: int) -> int:
    consumer = Consumer(shape, count)
    options = [v for pair in _pgoutput_options(shape).items() for v in pair]
    placeholders = ", ".join(["%s"] * len(options))
    peek = (
        "SELECT (lsn - '0/0'::pg_lsn)::bigint, data"
        f" FROM pg_logical_slot_peek_binary_changes(%s, NULL, %s, {placeholders})"
    )
    with psycopg.connect(conninfo, autocommit=True) as conn:
        pid = conn.info.backend_pid
        cursor = conn.cursor(binary=True)
        while not count.done:
            cursor.execute(peek, (slot, chunk, *options))
            feed = consumer.feed
            for lsn, data in cursor:
                feed(data, 0, lsn)
            advance = "SELECT pg_replication_slot_advance(%s, %s)"
            conn.execute(advance, (slot, format_lsn(count.last_end)))
        return _backend_cpu(pid)


def run_stream(
    conninfo: str, slot: str, shape: str, count: Count, publication: str | None = None
) -> int:
    consumer = Consumer(shape, count)
    stream = ReplicationStream(conninfo)
    pid = stream.backend_pid
    unpack = struct.Struct(">Q").unpack_from
    try:
        stream.start(slot, 0, _pgoutput_options(shape, publication))
        feed = consumer.feed
        while not count.done:
            for item in stream.read(10_000, 5.0):
                if item[0] == XLOG_DATA:
                    feed(item, XLOG_HEADER, unpack(item, 1)[0])
            stream.send_status(count.last_end)
        return _backend_cpu(pid)
    finally:
        stream.close()


def run_reader(conninfo: str, slot: str, count: Count) -> int:
    """The WAL source's reader, as a relay drives it (confirming each read's last commit)."""
    reader = WalReader(_url_of(conninfo), slot=slot, heartbeat=None)
    reader.start()
    try:
        assert reader._stream is not None
        pid = reader._stream.backend_pid
        while not count.done:
            items = reader.read(10_000, 5.0)
            for item in items:
                if isinstance(item, WalMessage):
                    count.messages += 1
                elif isinstance(item, Commit):
                    count.last_end = item.end_lsn
            reader.confirm(count.last_end)
        return _backend_cpu(pid)
    finally:
        reader.close()


def _url_of(conninfo: str) -> str:
    params = conninfo_to_dict(conninfo)
    return (
        f"postgresql+psycopg://{params['user']}:{params['password']}@{params['host']}:"
        f"{params['port']}/{params['dbname']}"
    )


def run_psycopg2(conninfo: str, slot: str, shape: str, count: Count) -> int:
    import psycopg2
    import psycopg2.extras

    consumer = Consumer(shape, count)
    factory = psycopg2.extras.LogicalReplicationConnection
    conn = psycopg2.connect(conninfo, connection_factory=factory)
    try:
        pid = conn.get_backend_pid()
        cursor = conn.cursor()
        cursor.start_replication(slot_name=slot, decode=False, options=_pgoutput_options(shape))
        feed = consumer.feed
        read = cursor.read_message
        while not count.done:
            message = read()
            if message is None:
                cursor.send_feedback(flush_lsn=count.last_end)
                select.select([conn], [], [], 5.0)
                continue
            feed(message.payload, 0, message.data_start)
        return _backend_cpu(pid)
    finally:
        conn.close()


def wal2json_message(change: dict[str, Any], lsn: int, commit_lsn: int) -> WalMessage:
    """A wal2json (format 2) insert of the outbox table into the relay's fields."""
    columns = {column["name"]: column["value"] for column in change["columns"]}
    key, value, names, values = (
        columns["key"],
        columns["value"],
        columns["header_names"],
        columns["header_values"],
    )
    return WalMessage(
        uuid.UUID(columns["id"]),
        columns["seq"],
        columns["shard"],
        columns["topic"],
        None if key is None else bytes.fromhex(key[2:]),
        None if value is None else bytes.fromhex(value[2:]),
        columns["content_type"],
        names,
        values,
        _timestamp(columns["created_at"]),
        lsn,
        commit_lsn,
    )


def _timestamp(text: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(text).timestamp()


class Wal2JsonConsumer:
    def __init__(self, count: Count) -> None:
        self.count = count
        self.out: list[WalMessage] = []
        self.commit_lsn = 0

    def feed(self, data: bytes | str, lsn: int) -> None:
        change = orjson.loads(data)
        action = change["action"]
        if action == "I":
            self.out.append(wal2json_message(change, lsn, self.commit_lsn))
        elif action == "B":
            self.commit_lsn = lsn
        elif action == "C":
            self.count.last_end = lsn
            self.count.messages += len(self.out)
            self.out.clear()


def run_wal2json_sql(conninfo: str, slot: str, count: Count, chunk: int) -> int:
    consumer = Wal2JsonConsumer(count)
    options = [v for pair in _WAL2JSON_OPTIONS.items() for v in pair]
    placeholders = ", ".join(["%s"] * len(options))
    peek = (
        "SELECT (lsn - '0/0'::pg_lsn)::bigint, data"
        f" FROM pg_logical_slot_peek_binary_changes(%s, NULL, %s, {placeholders})"
    )
    with psycopg.connect(conninfo, autocommit=True) as conn:
        pid = conn.info.backend_pid
        cursor = conn.cursor(binary=True)
        while not count.done:
            cursor.execute(peek, (slot, chunk, *options))
            for lsn, data in cursor:
                consumer.feed(data, lsn)
            # wal2json's commit carries the commit record's start: advance just past it
            conn.execute(
                "SELECT pg_replication_slot_advance(%s, %s)", (slot, format_lsn(count.last_end + 1))
            )
        return _backend_cpu(pid)


def run_wal2json_stream(conninfo: str, slot: str, count: Count) -> int:
    consumer = Wal2JsonConsumer(count)
    stream = ReplicationStream(conninfo)
    pid = stream.backend_pid
    unpack = struct.Struct(">Q").unpack_from
    try:
        stream.start(slot, 0, _WAL2JSON_OPTIONS)
        while not count.done:
            for item in stream.read(10_000, 5.0):
                if item[0] == XLOG_DATA:
                    consumer.feed(memoryview(item)[XLOG_HEADER:], unpack(item, 1)[0])
            stream.send_status(count.last_end + 1)
        return _backend_cpu(pid)
    finally:
        stream.close()


def _backend_cpu(pid: int) -> int:
    """A backend's CPU time so far, in clock ticks (user + system, from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _run_decoder(way: str, conninfo: str, slot: str, shape: str, count: Count, chunk: int) -> int:
    """Read the slot until ``count`` is done; the server backend's CPU ticks."""
    if way == "sql":
        return run_sql(conninfo, slot, shape, count, chunk)
    if way == "stream":
        return run_stream(conninfo, slot, shape, count)
    if way == "psycopg2":
        return run_psycopg2(conninfo, slot, shape, count)
    if way == "reader":
        return run_reader(conninfo, slot, count)
    if way == "reader-nogc":
        gc.disable()
        try:
            return run_reader(conninfo, slot, count)
        finally:
            gc.enable()
    if way == "stream-nofilter":
        return run_stream(conninfo, slot, shape, count, "probe_nofilter")
    if way == "wal2json-sql":
        return run_wal2json_sql(conninfo, slot, count, chunk)
    return run_wal2json_stream(conninfo, slot, count)


def measure_decoding(
    server: PostgresServer, database: str, messages: int, repeats: int, chunk: int
) -> list[dict[str, dict[str, float]]]:
    conninfo = server.conninfo(database)
    ticks = os.sysconf("SC_CLK_TCK")
    rounds = []
    for repeat in range(repeats):
        round_: dict[str, dict[str, float]] = {}
        shift = repeat % len(DECODERS)
        for decoder in DECODERS[shift:] + DECODERS[:shift]:
            shape, _, way = decoder.partition("/")
            slot = _slot(decoder, repeat)
            count = Count(messages)
            cpu_before, started = time.process_time(), time.monotonic()
            server_ticks = _run_decoder(way, conninfo, slot, shape, count, chunk)
            wall = time.monotonic() - started
            cpu = time.process_time() - cpu_before
            assert count.messages >= messages, (decoder, count.messages)
            per = 100_000 / count.messages
            round_[decoder] = {
                "msgs_per_s": count.messages / wall,
                "client_cpu_per_100k": cpu * per,
                "server_cpu_per_100k": server_ticks / ticks * per,
            }
            print(
                f"  round {repeat + 1} {decoder:<20} {count.messages / wall:>9,.0f} msgs/s  "
                f"client {cpu * per:5.2f} s  server {server_ticks / ticks * per:5.2f} s "
                "CPU per 100k"
            )
        rounds.append(round_)
    return rounds


# -- the run ---------------------------------------------------------------------------------


def _median(rounds: list[dict[str, dict[str, float]]], name: str, field: str) -> float:
    return statistics.median(r[name][field] for r in rounds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--writers", default="16,64")
    parser.add_argument("--seconds", type=int, default=8, help="per pgbench run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=10_000, help="changes per peek")
    parser.add_argument("--skip-writes", action="store_true")
    args = parser.parse_args(argv)
    clients = [int(c) for c in args.writers.split(",") if c]

    root = Path(tempfile.mkdtemp(prefix="bench-wal-probe-"))
    root.chmod(0o777)  # the server may run as the postgres user
    server = ProbeServer(root, free_port(), secrets.token_urlsafe(12), durable=True)
    try:
        server.start()
        url = server.create_database("bench")
        migrate.upgrade(url)
        with psycopg.connect(server.conninfo("bench"), autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (id bigint PRIMARY KEY, customer text, total int)")
            conn.execute("CREATE SEQUENCE order_ids START 1000000000")
            version = conn.execute("SHOW server_version").fetchone()
            level = conn.execute("SHOW wal_level").fetchone()
        print(
            f"machine: {machine()}; PostgreSQL {version and version[0]}, "
            f"wal_level={level and level[0]}, durable (fsync on)"
        )
        print(
            f"messages: {len(VALUE)}-byte value, {len(KEY)}-byte key, one per transaction; "
            f"repeats: {args.repeats}; load average at start {os.getloadavg()[0]:.1f}"
        )
        summary: dict[str, Any] = {"messages": args.messages, "repeats": args.repeats}
        if not args.skip_writes:
            print(f"\na. writers (pgbench, {args.seconds}s per run, order row + ...)")
            writes, wal = measure_writes(server, "bench", clients, args.seconds, args.repeats)
            per_message = {s: wal[s] - wal["base"] for s in WRITE_SHAPES if s != "base"}
            summary["wal_bytes_per_message"] = per_message
            summary["writes"] = {}
            for count, rounds in writes.items():
                med = {s: statistics.median(r[s] for r in rounds) for s in WRITE_SHAPES}
                ratios = {
                    s: statistics.median(r[s] / r["row"] for r in rounds) for s in WRITE_SHAPES
                }
                line = ", ".join(
                    f"{s} {med[s]:,.0f} tps ({ratios[s]:.2f} of row)" for s in WRITE_SHAPES
                )
                print(f"  writers {count:>2} median: {line}")
                summary["writes"][count] = {"tps": med, "of_row": ratios}
            print(
                "  WAL per message (beyond the order row's "
                f"{wal['base']:,.0f} B, no full-page images): "
                + ", ".join(f"{s} {b:,.0f} B" for s, b in per_message.items())
            )
        print(f"\nb. decoding {args.messages:,} messages into Python (peeks of {args.chunk:,})")
        prepare_decoding(server, "bench", args.messages, args.repeats)
        rounds = measure_decoding(server, "bench", args.messages, args.repeats, args.chunk)
        summary["decoding"] = {}
        for decoder in DECODERS:
            figures = {
                field: _median(rounds, decoder, field)
                for field in ("msgs_per_s", "client_cpu_per_100k", "server_cpu_per_100k")
            }
            ratio = statistics.median(
                r[decoder]["msgs_per_s"] / r["row/stream"]["msgs_per_s"] for r in rounds
            )
            summary["decoding"][decoder] = {**figures, "of_row_stream": ratio}
            print(
                f"  median {decoder:<20} {figures['msgs_per_s']:>9,.0f} msgs/s ({ratio:.2f} of "
                f"row/stream)  client {figures['client_cpu_per_100k']:5.2f} s  server "
                f"{figures['server_cpu_per_100k']:5.2f} s CPU per 100k"
            )
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
        print(json.dumps(summary))
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
