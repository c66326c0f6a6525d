"""deploy/ against a real relay: every metric and label the alerting rules and the Grafana
dashboard use exists on a running relay's /metrics, the health probes the Kubernetes
Deployment and the systemd units wire answer, and the commands and variables they run the
relay and the reconciliation with are ones the CLI accepts."""

from __future__ import annotations

import json
import os
import re
import shlex
import urllib.request
import uuid
from collections.abc import Iterator, Set
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

from outbox import Outbox
from outbox.cli import main as outbox_cli
from tests.relay_helpers import (
    publish_orders,
    start_relay_process,
    statuses,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "outbox-relay-rules.yml"
DASHBOARD = DEPLOY / "grafana" / "outbox-relay-dashboard.json"
DEPLOYMENT = DEPLOY / "kubernetes" / "relay-deployment.yaml"
CRONJOB = DEPLOY / "kubernetes" / "reconcile-cronjob.yaml"
SYSTEMD = DEPLOY / "systemd"

#: What the manifests' Secrets hold, for parsing their commands.
A_SECRET_URL = "postgresql+psycopg://role:pw@db/shop"
#: Labels Prometheus adds to every series it scrapes (target labels).
TARGET_LABELS = {"job", "instance"}
#: Series Prometheus makes itself for each target: ``up`` and its labels.
SYNTHETIC = {"up": TARGET_LABELS}
#: PromQL functions, aggregations and keywords the files use (anything else must be a metric).
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "absent", "and", "or", "unless", "bool", "offset",
}  # fmt: skip
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"\b([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
IDENTIFIER = re.compile(r"(?<![\w.$])[a-zA-Z_:][\w:]*")


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[tuple[str, str, set[str]]]:
    """(where, PromQL, labels its legend shows) for every panel target and templating query
    of the dashboard."""
    document = json.loads(DASHBOARD.read_text())
    queries = [
        (
            f"panel {panel['title']!r}",
            target["expr"],
            set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", ""))),
        )
        for panel in document["panels"]
        for target in panel["targets"]
    ]
    for variable in document["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            # Grafana's label_values(metric, label) reads what this PromQL would.
            query = re.sub(r"label_values\((\w+),\s*(\w+)\)", r"sum by (\2) (\1)", query)
            queries.append((f"variable {variable['name']}", query, set()))
    return queries


def references(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """The metrics an expression reads with the labels its selectors match on, and the labels
    it groups by."""
    metrics: dict[str, set[str]] = {}
    for name, matchers in SELECTOR.findall(expr):
        metrics.setdefault(name, set()).update(MATCHER.findall(matchers))
    grouping = {
        label.strip()
        for labels in GROUPING.findall(expr)
        for label in labels.split(",")
        if label.strip()
    }
    rest = GROUPING.sub(" ", expr)
    rest = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"|\$\{?\w+\}?", " ", rest)
    for word in IDENTIFIER.findall(rest):
        if word not in PROMQL_WORDS:
            metrics.setdefault(word, set())
    return metrics, grouping


def exposed_labels(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry, from a /metrics page."""
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def check(
    where: str, expr: str, exposed: dict[str, set[str]], extra: Set[str] = frozenset()
) -> None:
    """Every metric ``expr`` reads is exposed with the labels it matches on; the labels it
    groups by, and ``extra`` ones (a legend's, an annotation's), exist on one of them."""
    metrics, grouping = references(expr)
    assert metrics, f"{where}: no metric found in {expr!r}"
    available = set(TARGET_LABELS)
    for name, matched in metrics.items():
        assert name in exposed, f"{where}: {name} is not on the relay's /metrics ({expr!r})"
        unknown = matched - exposed[name] - TARGET_LABELS
        assert not unknown, f"{where}: {name} has no label {sorted(unknown)} ({expr!r})"
        available |= exposed[name]
    unknown = (grouping | extra) - available
    assert not unknown, f"{where}: no metric of {expr!r} has the labels {sorted(unknown)}"


def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return response.status, response.read().decode()


@pytest.fixture
def relay_metrics(  # type: ignore[no-untyped-def]
    engine, outbox_url, make_topic, bootstrap_servers, faulty_kafka, tmp_path
) -> Iterator[Any]:
    """A running `outbox relay` process whose /metrics has a sample of every metric: messages
    sent, a message too large for its topic (dead), and a delivery retried (a message of a
    topic that does not exist, while the others are taken)."""
    topic = make_topic("deploy")
    small = f"small-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    admin.create_topics([NewTopic(small, 1, 1, config={"max.message.bytes": "2000"})])[
        small
    ].result(30)
    relay = start_relay_process(
        outbox_url,
        f"127.0.0.1:{faulty_kafka.listen_port}",
        *("--delivery-timeout-ms", "2000", "--backoff-base", "0.1", "--backoff-max", "0.2"),
        log=tmp_path / "relay.log",
    )
    try:
        publish_orders(engine, topic, 20)
        with Outbox(engine).transaction() as tx:
            tx.publish(small, os.urandom(10_000))  # random bytes: compression cannot shrink it
        wait_for(lambda: statuses(engine) == {"sent": 20, "dead": 1}, 60, "sent and dead rows")
        # A message of a topic that does not exist times out (retriably) while the relay's
        # later batches keep being taken: the failure is the message's own, retried (an
        # outage would charge nothing), until the producer gives the topic up (dead).
        missing = f"missing-{uuid.uuid4().hex[:8]}"
        with Outbox(engine).transaction() as tx:
            tx.publish(missing, {"n": 0})
        written = [20]

        def retried() -> bool:
            publish_orders(engine, topic, 1, start=written[0])
            written[0] += 1
            return "outbox_relay_retried_total" in exposed_labels(scrape(relay.metrics_port)[1])

        wait_for(retried, 60, "a retried delivery")
        wait_for(lambda: statuses(engine) == {"sent": written[0], "dead": 2}, 60, "the rest sent")
        relay.exposed = exposed_labels(scrape(relay.metrics_port)[1])  # type: ignore[attr-defined]
        yield relay
    finally:
        assert stop_process(relay) == 0
        admin.delete_topics([small])


def test_every_alert_rule_reads_metrics_and_labels_the_relay_exposes(relay_metrics) -> None:  # type: ignore[no-untyped-def]
    exposed = {**relay_metrics.exposed, **SYNTHETIC}
    names = set()
    for rule in rules():
        names.add(rule["alert"])
        annotations = " ".join(rule.get("annotations", {}).values())
        used = set(re.findall(r"\$labels\.(\w+)", annotations))
        check(f"alert {rule['alert']}", rule["expr"], exposed, used)
    # What the operations docs promise an alert for.
    assert {
        "OutboxOldestPendingOverSLA",
        "OutboxDeadMessages",
        "OutboxShardsWithoutOwner",
        "OutboxRelayDown",
        "OutboxNoRelay",
    } <= names


def test_every_dashboard_query_reads_metrics_and_labels_the_relay_exposes(relay_metrics) -> None:  # type: ignore[no-untyped-def]
    exposed = {**relay_metrics.exposed, **SYNTHETIC}
    queries = dashboard_queries()
    for where, expr, legend in queries:
        check(where, expr, exposed, legend)
    used = {name for _, expr, _ in queries for name in references(expr)[0]}
    for family in ("published", "retried", "dead", "oldest_pending", "owned_shards"):
        assert any(name.startswith(f"outbox_relay_{family}") for name in used), family


def test_the_probes_wired_in_deploy_answer_on_a_running_relay(relay_metrics) -> None:  # type: ignore[no-untyped-def]
    (deployment, _budget) = yaml.safe_load_all(DEPLOYMENT.read_text())
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    env = {item["name"]: item.get("value", "from-a-secret") for item in container["env"]}
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert env["OUTBOX_RELAY_METRICS_HOST"] == "0.0.0.0"  # the kubelet probes the pod's address
    assert int(env["OUTBOX_RELAY_METRICS_PORT"]) == ports["metrics"]
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == ports["metrics"]
    probes = {kind: container[kind]["httpGet"] for kind in ("livenessProbe", "readinessProbe")}
    assert {probe["port"] for probe in probes.values()} == {"metrics"}
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    for probe in probes.values():
        assert scrape(relay_metrics.metrics_port, probe["path"])[0] == 200
    assert scrape(relay_metrics.metrics_port, pod["metadata"]["annotations"]["prometheus.io/path"])

    unit = systemd_unit("outbox-relay.service")["Service"]
    port = dict(line.split("=", 1) for line in unit["Environment"])["OUTBOX_RELAY_METRICS_PORT"]
    (health,) = systemd_unit("outbox-relay-health.service")["Service"]["ExecStart"]
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w+)", health)
    assert url is not None and url.group(1) == port and url.group(2) == "/healthz"
    assert scrape(relay_metrics.metrics_port, url.group(2))[0] == 200


def systemd_unit(name: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as section -> key -> values (keys such as Environment= repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in (SYSTEMD / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def cli_accepts(args: list[str], env: dict[str, str]) -> None:
    """Parse ``outbox ARGS`` with the real CLI and ``env``, down to its sub-command; every
    OUTBOX_ variable must be one the command reads."""
    command: click.Command = outbox_cli
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        ctx = command.make_context("outbox", list(args))
        while isinstance(command, click.Group):
            rest = [*ctx._protected_args, *ctx.args]
            if not rest:
                break
            name, sub, sub_args = command.resolve_command(ctx, rest)
            assert sub is not None and name is not None
            ctx = sub.make_context(name, sub_args, parent=ctx)
            command = sub
    known = {param.envvar for param in command.params if isinstance(param.envvar, str)}
    for name in env:
        assert name in known or name.startswith("OUTBOX_KAFKA_"), (
            f"`outbox {shlex.join(args)}` reads no {name}"
        )


def test_the_relay_and_reconcile_commands_in_deploy_are_ones_the_cli_accepts() -> None:
    (deployment, _budget) = yaml.safe_load_all(DEPLOYMENT.read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {
        item["name"]: item.get("value", "postgresql+psycopg://u:p@db/x")
        for item in container["env"]
    }
    assert container["command"] == ["outbox"]
    cli_accepts(container["args"], env)

    cronjob = yaml.safe_load(CRONJOB.read_text())
    (job,) = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item.get("value", A_SECRET_URL) for item in job["env"]}
    assert job["command"] == ["outbox"]
    cli_accepts(job["args"], env)

    unit = systemd_unit("outbox-relay.service")["Service"]
    env = dict(line.split("=", 1) for line in unit["Environment"])
    env_file = (SYSTEMD / "relay.env").read_text().splitlines()
    env.update(line.split("=", 1) for line in env_file if line and not line.startswith("#"))
    (exec_start,) = unit["ExecStart"]
    program, *args = shlex.split(exec_start)
    assert program.endswith("/outbox")
    cli_accepts(args, env)
