"""The local stack as one unit: prepare, up, down, status; state kept in a JSON file.

Layout under the stack home (``OUTBOX_STACK_HOME``, default ``<repo>/.stack``)::

    jars/kafka/   broker jars, resolved once from Maven Central
    jars/spark/   Spark's Kafka source and the PostgreSQL JDBC driver
    run/<name>/   one stack's servers: state.json, postgres/ (and postgres-standby/), kafka/
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.devstack.browser import chromium
from outbox.devstack.cluster import KafkaCluster
from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.maven import resolve_jars
from outbox.devstack.postgres import PostgresServer, data_root_for, server_bindir
from outbox.devstack.procs import StackError, free_port, pid_alive, port_open
from outbox.devstack.replication import (
    REPLICATION_MODES,
    build_standby,
    in_recovery,
    libpq_multi_host_url,
    multi_host_url,
    promote,
    set_replication,
)

DEMO_DATABASE = "outbox"


def stack_home() -> Path:
    override = os.environ.get("OUTBOX_STACK_HOME")
    if override:
        return Path(override).resolve()
    return Path(__file__).resolve().parent.parent / ".stack"


def kafka_jars() -> list[Path]:
    return resolve_jars("kafka", stack_home() / "jars" / "kafka")


def kafka_tools_jars() -> list[Path]:
    """Kafka's command-line tools (the benchmark's ProducerPerformance)."""
    return resolve_jars("kafka-tools", stack_home() / "jars" / "kafka-tools")


def spark_jars() -> list[Path]:
    """Jars to put on Spark's classpath (``spark.jars``) for the Kafka source and JDBC."""
    return resolve_jars("spark", stack_home() / "jars" / "spark")


def prepare() -> None:
    """Install or resolve everything the servers need; safe to run again."""
    server_bindir()
    chromium()  # the dashboard's browser tests
    kafka_jars()
    spark_jars()


@dataclass(frozen=True)
class StackInfo:
    """How to reach a running stack."""

    database_url: str
    bootstrap_servers: str
    spark_jars: tuple[str, ...]
    #: With a standby: the same multi-host URL in libpq's own form (``host=a,b&port=x,y``).
    libpq_database_url: str | None = None

    def as_env(self) -> dict[str, str]:
        env = {
            "OUTBOX_DATABASE_URL": self.database_url,
            "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "OUTBOX_SPARK_JARS": ",".join(self.spark_jars),
        }
        if self.libpq_database_url:
            env["OUTBOX_DATABASE_LIBPQ_URL"] = self.libpq_database_url
        return env


class LocalStack:
    """PostgreSQL + Kafka servers owned by one run folder.

    ``up`` is idempotent: servers already running are kept, dead ones are restarted on the
    ports recorded in ``state.json`` (new free ports when those are taken).

    ``standby`` (``sync`` or ``async``; default: what the stack already runs, else none) adds
    a streaming standby of PostgreSQL (:mod:`outbox.devstack.replication`); :meth:`promote`
    fails over to it, and the next ``up`` builds a new standby from the new primary.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        durable: bool = True,
        brokers: int | None = None,
        standby: str | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.state_file = run_dir / "state.json"
        self.durable = durable
        state = self._load_state()
        pg_state = state.get("postgres", {})
        standby_state = state.get("standby", {})
        kafka_state = state.get("kafka", {})
        recorded_brokers = int(kafka_state.get("brokers") or 1)
        if brokers is not None and recorded_brokers != brokers and self._kafka_recorded(state):
            raise StackError(
                f"stack {run_dir.name!r} runs {recorded_brokers} Kafka node(s), not {brokers}: "
                f"`outbox dev down --name {run_dir.name}` first"
            )
        self.brokers = brokers or recorded_brokers
        if self.brokers < 1:
            raise StackError("a stack needs at least one Kafka node")
        self.postgres = PostgresServer(
            root=Path(pg_state.get("root") or data_root_for(run_dir)),
            port=int(pg_state.get("port") or 0),
            password=pg_state.get("password") or secrets.token_urlsafe(18),
            durable=durable,
        )
        if standby is not None and standby not in REPLICATION_MODES:
            raise StackError(f"a standby is {' or '.join(REPLICATION_MODES)}, not {standby!r}")
        #: ``sync``, ``async``, or None: no standby.
        self.replication: str | None = standby or standby_state.get("replication")
        #: Given the primary, the port its standby streams from (default: the primary's).
        self.stream_port: Callable[[PostgresServer], int] | None = None
        self.standby: PostgresServer | None = None
        if self.replication:
            self.standby = PostgresServer(
                root=Path(standby_state.get("root") or _standby_root(self.postgres.root)),
                port=int(standby_state.get("port") or 0),
                password=self.postgres.password,
                durable=durable,
            )
        self.kafka = KafkaBroker(
            root=run_dir / "kafka",
            jars=[],
            port=int(kafka_state.get("port") or 0),
            controller_port=int(kafka_state.get("controller_port") or 0),
        )
        #: The cluster, when the stack has more than one Kafka node; ``kafka`` is then unused.
        self.cluster: KafkaCluster | None = None
        if self.brokers > 1:
            nodes = kafka_state.get("nodes") or [[0, 0]] * self.brokers
            self.cluster = KafkaCluster.create(
                run_dir / "kafka",
                [],
                [(int(port), int(controller)) for port, controller in nodes],
                kafka_state.get("cluster_id"),
            )

    @classmethod
    def named(
        cls,
        name: str,
        *,
        durable: bool = True,
        brokers: int | None = None,
        standby: str | None = None,
    ) -> LocalStack:
        return cls(stack_home() / "run" / name, durable=durable, brokers=brokers, standby=standby)

    @property
    def bootstrap_servers(self) -> str:
        """Every Kafka node's address."""
        return self.cluster.bootstrap_servers if self.cluster else self.kafka.bootstrap_servers

    def kafka_nodes(self) -> list[KafkaBroker]:
        return self.cluster.nodes if self.cluster else [self.kafka]

    def up(self, database: str | None = DEMO_DATABASE) -> StackInfo:
        """Start whatever is not running; create ``database`` when missing."""
        started = time.monotonic()
        self.up_postgres()
        self.up_standby()
        self.up_kafka()
        self._save_state(started_in=round(time.monotonic() - started, 1))
        if database:
            self.ensure_database(database)
        return self.info(database or "postgres")

    def up_postgres(self) -> PostgresServer:
        if not self.postgres.running():
            self.postgres.port = _usable_port(self.postgres.port)
            self._save_state()
            self.postgres.start()
        return self.postgres

    def up_standby(self) -> PostgresServer | None:
        """Start the standby, or build it from the primary (the first time, and after a
        promotion); set the primary's replication to the stack's mode."""
        standby = self.standby
        if standby is None or self.replication is None:
            return None
        if not standby.running():
            standby.port = _usable_port(standby.port, avoid=self.postgres.port)
            self._save_state()
            if (standby.data_dir / "standby.signal").exists():
                standby.start()  # it streams on from where it stopped (its slot kept the WAL)
            else:
                route = self.stream_port(self.postgres) if self.stream_port else None
                build_standby(self.postgres, standby, self.replication, stream_port=route)
        elif not in_recovery(standby):
            raise StackError(
                f"the standby on port {standby.port} is a primary itself: "
                f"`outbox dev down --name {self.run_dir.name}` and start again"
            )
        set_replication(self.postgres, self.replication)
        self._save_state()
        return standby

    def promote(self) -> PostgresServer:
        """Fail over: ``kill -9`` the primary and promote the standby, which becomes the
        primary; the old primary's folder is kept until a standby is built there (by the
        next :meth:`up_standby`, on the old primary's port, so the stack's URL stays)."""
        standby = self.standby
        if standby is None or not standby.running():
            raise StackError(f"stack {self.run_dir.name!r} has no standby running to promote")
        old = self.postgres
        old.kill()
        promote(standby)
        (old.data_dir / "standby.signal").unlink(missing_ok=True)  # not a standby to resume
        self.postgres, self.standby = standby, old
        self._save_state()
        return standby

    def up_kafka(self) -> KafkaBroker:
        if self.cluster is not None:
            self._up_cluster(self.cluster)
            return self.cluster.nodes[0]
        if not self.kafka.running():
            self.kafka.jars = kafka_jars()
            self.kafka.port = _usable_port(self.kafka.port)
            self.kafka.controller_port = _usable_port(
                self.kafka.controller_port, avoid=self.kafka.port
            )
            self._save_state()
            self.kafka.start()
        return self.kafka

    def _up_cluster(self, cluster: KafkaCluster) -> None:
        if cluster.running():
            return
        jars = kafka_jars()
        taken: set[int] = set()
        for node in cluster.nodes:
            node.jars = jars
            if not node.running():
                node.port = _usable_port(node.port, avoid=taken)
                taken.add(node.port)
                node.controller_port = _usable_port(node.controller_port, avoid=taken)
            taken.update((node.port, node.controller_port))
        cluster.name_voters()
        self._save_state()
        cluster.start()

    def down(self) -> None:
        """Stop the servers and forget their data."""
        errors: list[str] = []
        stops: list[Callable[[], None]] = [n.stop for n in self.kafka_nodes()]
        servers = [self.postgres, *([self.standby] if self.standby else [])]
        for stop in (*stops, *(server.stop for server in servers)):
            try:
                stop()
            except StackError as exc:
                errors.append(str(exc))
        if errors:
            raise StackError("; ".join(errors))
        for server in servers:
            shutil.rmtree(server.root, ignore_errors=True)
            # Killed primaries a chaos run kept aside for its audit (outbox.chaos.stack).
            for kept in server.root.parent.glob(f"{server.root.name}-old-*"):
                shutil.rmtree(kept, ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def database_url(self, database: str = DEMO_DATABASE) -> str:
        """The primary's URL; with a standby, one that lists both servers and follows the
        primary through a promotion."""
        if self.standby is None:
            return self.postgres.url(database)
        return multi_host_url(self.servers, database)

    @property
    def servers(self) -> list[PostgresServer]:
        """The PostgreSQL servers, in the order of their ports (which a promotion keeps)."""
        found = [self.postgres, *([self.standby] if self.standby else [])]
        return sorted(found, key=lambda server: server.port)

    def info(self, database: str = DEMO_DATABASE) -> StackInfo:
        return StackInfo(
            database_url=self.database_url(database),
            bootstrap_servers=self.bootstrap_servers,
            spark_jars=tuple(str(jar) for jar in spark_jars()),
            libpq_database_url=libpq_multi_host_url(self.servers, database)
            if self.standby
            else None,
        )

    def status(self) -> dict[str, bool]:
        servers = {"postgres": self.postgres.running()}
        if self.standby is not None:
            servers[f"postgres standby ({self.replication})"] = self.standby.running()
        if self.cluster is None:
            return {**servers, "kafka": self.kafka.running()}
        nodes = {f"kafka node {n.node_id}": n.running() for n in self.cluster.nodes}
        return {**servers, **nodes}

    def ensure_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.postgres.conninfo(), autocommit=True) as conn:
            query = "SELECT 1 FROM pg_database WHERE datname = %s"
            exists = conn.execute(query, (name,)).fetchone()
        if not exists:
            self.postgres.create_database(name)

    def _load_state(self) -> dict[str, Any]:
        try:
            loaded = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def _kafka_state(self) -> dict[str, object]:
        if self.cluster is None:
            return {"port": self.kafka.port, "controller_port": self.kafka.controller_port}
        return {
            "brokers": self.brokers,
            "cluster_id": self.cluster.cluster_id,
            "nodes": [[n.port, n.controller_port] for n in self.cluster.nodes],
        }

    def _standby_state(self) -> dict[str, object]:
        if self.standby is None:
            return {}
        standby = {"root": str(self.standby.root), "port": self.standby.port}
        return {"standby": {**standby, "replication": self.replication}}

    @staticmethod
    def _kafka_recorded(state: dict[str, Any]) -> bool:
        kafka = state.get("kafka") or {}
        return bool(kafka.get("port") or kafka.get("nodes"))

    def _save_state(self, **extra: object) -> None:
        state = {
            "owner_pid": os.getpid(),
            "postgres": {
                "root": str(self.postgres.root),
                "port": self.postgres.port,
                "password": self.postgres.password,
            },
            "kafka": self._kafka_state(),
            **self._standby_state(),
            **extra,
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.chmod(0o600)  # holds the cluster's password
        tmp.replace(self.state_file)


def _standby_root(primary_root: Path) -> Path:
    """Beside the first primary's folder (both may live under /tmp, see data_root_for)."""
    return primary_root.with_name(primary_root.name + "-standby")


def _usable_port(recorded: int, avoid: int | set[int] = 0) -> int:
    avoided = avoid if isinstance(avoid, set) else {avoid}
    if recorded and recorded not in avoided and not port_open(recorded):
        return recorded
    while True:
        port = free_port()
        if port not in avoided:
            return port


def sweep_stale_runs(prefix: str, runs_dir: Path | None = None) -> list[str]:
    """Stop and remove ``run/<prefix>*`` stacks whose owning process is gone.

    A test session killed with -9 leaves its servers running; the next session cleans up.
    """
    removed = []
    for run_dir in sorted((runs_dir or stack_home() / "run").glob(f"{prefix}*")):
        try:
            owner = json.loads((run_dir / "state.json").read_text()).get("owner_pid")
        except (OSError, ValueError):
            owner = None
        if pid_alive(owner) and owner != os.getpid():
            continue
        LocalStack(run_dir).down()
        removed.append(run_dir.name)
    return removed
