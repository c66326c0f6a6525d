"""The chaos run's own servers: PostgreSQL, Kafka (one broker, or a cluster of three nodes)
with a second listener per node that the relays and the consumers reach through a fault proxy
of that node, the proxies themselves, and a proxy in front of PostgreSQL that only the relays
connect through.

Each node advertises its proxy's port on that listener, so every connection a relay's or a
consumer's Kafka client makes (bootstrap, partition leaders and the coordinators alike) goes
through a proxy, and a network fault hits all of them at once. The harness itself (topic
set-up, the audit) uses the nodes' plain listeners, untouched by network faults. The consuming
service's database lives on the same PostgreSQL cluster, so a database restart hits both
services; the database proxy's faults hit the relays' path alone (the writers, the consumers
and the audit connect directly).

With a standby (``replication``), the writers, the consumers and the audit connect with the
URL that lists both servers (libpq finds the primary), and the relays' proxy stands for the
address a failover manager moves to the promoted server (a virtual IP, or a proxy that
checks which server is the primary): :meth:`ChaosStack.promote_standby` points it there.
Each killed primary's folder is kept (:attr:`ChaosStack.old_primaries`), so that the audit
can read what the promotion forgot.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from outbox.chaos.proxy import FaultProxy
from outbox.devstack.cluster import KafkaCluster
from outbox.devstack.kafka import KafkaBroker
from outbox.devstack.postgres import PostgresServer
from outbox.devstack.procs import StackError, free_port
from outbox.devstack.replication import promote
from outbox.devstack.stack import LocalStack, StackInfo, stack_home

DATABASE = "chaos"
#: How far behind its primary an asynchronous standby streams (milliseconds): its WAL passes
#: a proxy that holds it this long, as a standby far away, or a busy one, lags. A
#: synchronous standby streams straight from the primary (every commit waits for it).
ASYNCHRONOUS_LAG_MS = 200
SERVICE_DATABASE = "chaos_service"  # the consuming service's
#: How long a heal waits for Kafka nodes to serve again. A node stopped mid-stream loads every
#: partition's log (the transaction and offset topics' too) before it serves; on a loaded
#: two-core machine two nodes of a cluster restarting together have outlasted a stack's
#: START_TIMEOUT (90 s).
HEAL_TIMEOUT = 240.0


def route_through_proxy(kafka: KafkaBroker, proxy: FaultProxy) -> None:
    """Give ``kafka`` (not started yet) a second listener that it advertises at the proxy's
    port, the proxy forwarding to it: clients bootstrapped at the proxy reach the broker only
    through it. The broker's plain listener stays as it is."""
    kafka.port = free_port()
    kafka.controller_port = free_port()
    kafka.extra_config = {
        "listeners": (
            f"PLAINTEXT://127.0.0.1:{kafka.port},"
            f"RELAYS://127.0.0.1:{proxy.upstream_port},"
            f"CONTROLLER://127.0.0.1:{kafka.controller_port}"
        ),
        "advertised.listeners": (
            f"PLAINTEXT://127.0.0.1:{kafka.port},RELAYS://127.0.0.1:{proxy.listen_port}"
        ),
        "listener.security.protocol.map": (
            "PLAINTEXT:PLAINTEXT,RELAYS:PLAINTEXT,CONTROLLER:PLAINTEXT"
        ),
    }


class ProxyGroup:
    """The fault proxies of every Kafka node, faulted and healed together."""

    def __init__(self, proxies: list[FaultProxy]) -> None:
        self.proxies = proxies

    def _each(self, act: Callable[[FaultProxy], None]) -> None:
        for proxy in self.proxies:
            act(proxy)

    def start(self) -> None:
        self._each(FaultProxy.start)

    def close(self) -> None:
        self._each(FaultProxy.close)

    def set_latency(self, milliseconds: int) -> None:
        self._each(lambda proxy: proxy.set_latency(milliseconds))

    def stall(self) -> None:
        self._each(FaultProxy.stall)

    def drop(self) -> None:
        self._each(FaultProxy.drop)

    def heal(self) -> None:
        self._each(FaultProxy.heal)


class ChaosStack:
    """Servers under ``<stack home>/run/<name>``, removed by :meth:`down`; ``brokers`` Kafka
    nodes (a cluster when more than one)."""

    def __init__(
        self,
        name: str,
        run_dir: Path | None = None,
        brokers: int = 1,
        replication: str | None = None,
    ) -> None:
        self.local = LocalStack(
            run_dir or stack_home() / "run" / name,
            durable=True,
            brokers=brokers,
            standby=replication,
        )
        #: The folders of the primaries killed by failovers, oldest first.
        self.old_primaries: list[Path] = []
        #: In front of the primary for an asynchronous standby's stream (see
        #: ASYNCHRONOUS_LAG_MS); moved to each new primary as its standby is built.
        self.replication_proxy: FaultProxy | None = None
        if replication == "async":
            self.replication_proxy = FaultProxy(free_port(), 0)
            self.local.stream_port = self._stream_through_proxy
        proxies = []
        for node in self.local.kafka_nodes():
            proxies.append(FaultProxy(free_port(), free_port()))
            route_through_proxy(node, proxies[-1])
        if self.local.cluster is not None:
            self.local.cluster.name_voters()  # the controller ports changed
        self.proxy = ProxyGroup(proxies)
        #: In front of PostgreSQL for the relays; made in :meth:`up`, once its port is known.
        self.database_proxy: FaultProxy | None = None
        self.info: StackInfo | None = None

    @property
    def postgres(self) -> PostgresServer:
        return self.local.postgres

    @property
    def cluster(self) -> KafkaCluster | None:
        """The Kafka cluster, when the stack has more than one node."""
        return self.local.cluster

    @property
    def kafka_nodes(self) -> list[KafkaBroker]:
        return self.local.kafka_nodes()

    def start_kafka(self) -> None:
        """Start every Kafka node that is down, and wait until all serve (up to
        HEAL_TIMEOUT)."""
        if self.cluster is not None:
            self.cluster.start(HEAL_TIMEOUT)
        else:
            self.local.kafka.start(HEAL_TIMEOUT)

    @property
    def run_dir(self) -> Path:
        return self.local.run_dir

    @property
    def proxied_bootstrap(self) -> str:
        """Where relays and consumers connect: the proxies."""
        return ",".join(f"127.0.0.1:{proxy.listen_port}" for proxy in self.proxy.proxies)

    @property
    def direct_bootstrap(self) -> str:
        """The nodes' own listeners, for set-up and the audit."""
        return self.local.bootstrap_servers

    @property
    def database_url(self) -> str:
        assert self.info is not None, "the stack is not up"
        return self.info.database_url

    @property
    def relay_database_url(self) -> str:
        """The outbox database reached through the database proxy: the relays' way in."""
        assert self.database_proxy is not None, "the stack is not up"
        url = sa.make_url(self.postgres.url(DATABASE)).set(port=self.database_proxy.listen_port)
        return url.render_as_string(hide_password=False)

    def service_database_url(self) -> str:
        """The consuming service's database, created when missing."""
        self.local.ensure_database(SERVICE_DATABASE)
        return self.local.database_url(SERVICE_DATABASE)

    def conninfo(self, database: str | None = None) -> str:
        """libpq connection string (of ``database``, if given) on the primary, whichever
        server that is."""
        servers = self.local.servers
        hosts = ",".join("127.0.0.1" for _ in servers)
        ports = ",".join(str(server.port) for server in servers)
        conninfo = (
            f"host={hosts} port={ports} user=postgres password={self.postgres.password} "
            "target_session_attrs=read-write"
        )
        return f"{conninfo} dbname={database}" if database else conninfo

    # -- failover ------------------------------------------------------------------------

    @property
    def replication(self) -> str | None:
        return self.local.replication

    def kill_primary(self) -> float:
        """``kill -9`` of every process of the primary, as when its machine dies; returns
        the wall-clock time of the kill."""
        # The WAL on its way to an asynchronous standby dies with the machine.
        lost_in_flight = self.replication_proxy.drop if self.replication_proxy else None
        return self.postgres.kill(at_once=lost_in_flight)

    def promote_standby(self) -> None:
        """Promote the standby, move the relays' address to it, and keep the dead primary's
        folder aside for the audit (a new standby is built where it was)."""
        old, standby = self.local.postgres, self.local.standby
        if standby is None:
            raise StackError("the stack has no standby to promote")
        promote(standby)
        if self.database_proxy is not None:
            self.database_proxy.retarget(standby.port)
        kept = old.root.with_name(f"{old.root.name}-old-{len(self.old_primaries) + 1}")
        old.root.rename(kept)
        self.old_primaries.append(kept)
        self.local.postgres, self.local.standby = standby, old
        self.local._save_state()

    def rebuild_standby(self) -> float:
        """Build a new standby from the primary (on the old primary's port); returns the
        seconds it took, until it had caught up."""
        started = time.monotonic()
        self.local.up_standby()
        return time.monotonic() - started

    def _stream_through_proxy(self, primary: PostgresServer) -> int:
        assert self.replication_proxy is not None
        self.replication_proxy.retarget(primary.port)
        self.replication_proxy.heal()
        self.replication_proxy.set_latency(ASYNCHRONOUS_LAG_MS)
        return self.replication_proxy.listen_port

    def up(self) -> StackInfo:
        if self.replication_proxy is not None:
            self.replication_proxy.start()
            self.replication_proxy.set_latency(ASYNCHRONOUS_LAG_MS)
        self.proxy.start()
        self.info = self.local.up(database=DATABASE)
        self.database_proxy = FaultProxy(free_port(), self.postgres.port)
        self.database_proxy.start()
        return self.info

    def down(self, keep_files: bool = False) -> None:
        self.proxy.close()
        if self.replication_proxy is not None:
            self.replication_proxy.close()
        if self.database_proxy is not None:
            self.database_proxy.close()
        if not keep_files:
            self.local.down()  # stops the servers and removes their folders
            for folder in self.old_primaries:
                shutil.rmtree(folder, ignore_errors=True)
            return
        for node in self.kafka_nodes:
            node.stop()
        for server in self.local.servers:
            server.stop()
