"""An Apache Kafka node in KRaft mode (combined broker and controller), run from Maven Central
jars: alone, or as one node of a :class:`~outbox.devstack.cluster.KafkaCluster`."""

from __future__ import annotations

import base64
import functools
import os
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from outbox.devstack.procs import StackError, pid_alive, port_open, terminate, wait_until

START_TIMEOUT = 90.0
HEAP = "-Xmx768m"
#: ZGC collects beside the application: G1's young pauses (8-18 ms every few seconds on this
#: heap) set most of a relay's commit-to-ack tail at 1,000 msgs/s (docs/benchmarks.md).
CONCURRENT_COLLECTOR = "-XX:+UseZGC"
#: For a JVM without ZGC (JDK 17 has it on Linux x64 and aarch64, macOS and Windows only).
FALLBACK_COLLECTOR = "-XX:+UseG1GC"
#: Partitions of ``__transaction_state`` and ``__consumer_offsets``.
INTERNAL_PARTITIONS = 8

LOG4J2_CONFIG = """\
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = {level}
rootLogger.appenderRef.stdout.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = {level}
logger.state.name = state.change.logger
logger.state.level = warn
"""


@dataclass
class KafkaBroker:
    """One combined broker+controller; ``root`` holds its config, data and log.

    Alone by default. As a cluster node it has its ``node_id``, the cluster's controller
    ``voters`` (``id@host:port,...``), the ``cluster_id`` every node is formatted with, and
    the cluster's ``replication`` for internal topics (``min.insync.replicas`` one less).
    """

    root: Path
    jars: list[Path]
    port: int
    controller_port: int
    extra_config: dict[str, str] = field(default_factory=dict)
    node_id: int = 1
    voters: str | None = None
    cluster_id: str | None = None
    replication: int = 1
    heap: str = HEAP
    # Kept so this process can reap the broker it started (and Python does not warn about it).
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.root / "server.log"

    @property
    def gc_log(self) -> Path:
        return self.root / "gc.log"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def pid_file(self) -> Path:
        return self.root / "broker.pid"

    @property
    def pid(self) -> int | None:
        """The broker's process id, kept in a file so that a killed caller leaves a trace."""
        try:
            return int(self.pid_file.read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        return pid_alive(self.pid)

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Format the storage on first use, start the broker and wait until it serves metadata
        (up to ``timeout`` seconds)."""
        if self.running():
            return
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Format the storage on first use and start the process, without waiting for it (a
        cluster's nodes serve nothing until a majority of controllers runs)."""
        if self.running():
            return
        java = shutil.which("java")
        if java is None:
            raise StackError(
                "Java is not on PATH: install JDK 17 (Debian: openjdk-17-jre-headless)"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "server.properties"
        config.write_text(self._server_properties())
        (self.root / "log4j2.properties").write_text(LOG4J2_CONFIG.format(level="INFO"))
        if not (self.data_dir / "meta.properties").exists():
            self._format(java, config)
        with self.log_file.open("ab") as log:
            process = subprocess.Popen(
                [
                    java,
                    self.heap,
                    collector(java),
                    # Pauses and allocation stalls, to look at when appends are slow.
                    f"-Xlog:gc,gc+phases:file={self.gc_log}:time,uptime:filecount=2,filesize=10m",
                    "-Djava.awt.headless=true",
                    f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}",
                    "-cp",
                    self._classpath(),
                    "kafka.Kafka",
                    str(config),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the caller's terminal must not reach it
            )
        self._process = process
        self.pid_file.write_text(str(process.pid))

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until the node serves metadata; stopped and reported if it does not."""
        try:
            wait_until(self._ready, timeout, f"Kafka on {self.bootstrap_servers}")
        except StackError as exc:
            self.stop()
            raise StackError(
                f"{exc}; broker log {self.log_file} ends:\n{self._log_tail()}"
            ) from exc

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        pid = self.pid
        if pid is not None:
            terminate(pid, grace=30.0)
        if self._process is not None:
            self._process.wait(timeout=10)
            self._process = None
        self.pid_file.unlink(missing_ok=True)

    def kill(self) -> None:
        """kill -9, as a crash: the next start recovers the logs."""
        pid = self.pid
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not pid_alive(pid), 30, f"broker {pid} to die")
        if self._process is not None:
            self._process.wait(timeout=10)
            self._process = None
        self.pid_file.unlink(missing_ok=True)

    def _ready(self) -> bool:
        if not self.running():
            raise StackError(f"Kafka exited during start-up; see {self.log_file}")
        if not port_open(self.port):
            return False
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        try:
            metadata = admin.list_topics(timeout=2)
        except Exception:
            return False
        return bool(metadata.brokers)

    def _classpath(self) -> str:
        if not self.jars:
            raise StackError("no Kafka jars: run `outbox dev prepare`")
        return ":".join(str(jar) for jar in self.jars)

    def _format(self, java: str, config: Path) -> None:
        output = ""
        for _ in range(2):  # a second try on a clean folder, with the first failure kept
            if self.data_dir.exists():
                shutil.rmtree(self.data_dir)  # storage from an interrupted format
            cluster_id = self.cluster_id or new_cluster_id()
            result = subprocess.run(
                [
                    java,
                    "-cp",
                    self._classpath(),
                    f"-Dlog4j2.configurationFile={self.root / 'log4j2.properties'}",
                    "kafka.tools.StorageTool",
                    "format",
                    "-t",
                    cluster_id,
                    "-c",
                    str(config),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode == 0:
                return
            output += f"exit {result.returncode}: ...{(result.stdout + result.stderr)[-1500:]}\n"
            (self.root / "format-failure.log").write_text(result.stdout + result.stderr)
        raise StackError(f"formatting Kafka storage failed: {output}")

    def _server_properties(self) -> str:
        min_isr = max(1, self.replication - 1)
        settings = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": (
                self.voters or f"{self.node_id}@127.0.0.1:{self.controller_port}"
            ),
            "listeners": (
                f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            # Internal topics on every node (one alone); a write needs all but one of them.
            "offsets.topic.replication.factor": str(self.replication),
            "offsets.topic.num.partitions": str(INTERNAL_PARTITIONS),
            "transaction.state.log.replication.factor": str(self.replication),
            "transaction.state.log.min.isr": str(min_isr),
            "transaction.state.log.num.partitions": str(INTERNAL_PARTITIONS),
            "share.coordinator.state.topic.replication.factor": str(self.replication),
            "share.coordinator.state.topic.min.isr": str(min_isr),
            "default.replication.factor": str(self.replication),
            "min.insync.replicas": str(min_isr),
            "group.initial.rebalance.delay.ms": "0",
            **self.extra_config,
        }
        return "".join(f"{key}={value}\n" for key, value in settings.items())


@functools.cache
def collector(java: str) -> str:
    """The garbage collector for a broker on ``java``: ZGC when that JVM has it, else G1."""
    probe = subprocess.run(
        [java, CONCURRENT_COLLECTOR, "-version"], capture_output=True, check=False, timeout=60
    )
    return CONCURRENT_COLLECTOR if probe.returncode == 0 else FALLBACK_COLLECTOR


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, base64url without padding, never starting with
    '-' (the storage tool would read such an id as an option)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id
