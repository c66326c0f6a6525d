"""docs/guide-existing-service.md, walked end to end with its example (examples/fastapi_service):
one Alembic history for the service's tables and the outbox's, the order service under uvicorn
over real HTTP, `outbox relay` and `outbox consume` as processes, the fulfilment service's
inbox applying each order once; and the other Alembic way, `alembic merge`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from outbox.devstack.procs import free_port
from tests.integration.test_fastapi_service import create_customer, line, serving
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fastapi_service"
GUIDE = ROOT / "docs" / "guide-existing-service.md"
BIN = Path(sys.executable).parent


def command(
    *args: str, env: dict[str, str], check: bool = True
) -> subprocess.CompletedProcess[str]:
    """A documented command line (alembic, outbox, python) run from the checkout's root."""
    program = args[0] if args[0] != "python" else Path(sys.executable).name
    result = subprocess.run(
        [str(BIN / program), *args[1:]],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    if check:
        assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


def documented(text: str) -> str:
    """``text``, after checking that the guide says it verbatim (guide and test cannot drift)."""
    assert text in GUIDE.read_text(), f"the guide no longer says: {text}"
    return text


def tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


@contextmanager
def daemon(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`outbox ...` in a process of its own; stopped with SIGTERM, which it must obey."""
    with log.open("wb") as output:
        process = subprocess.Popen(
            [str(BIN / "outbox"), *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        assert code == 0, log.read_text()


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_the_guide_from_migrations_to_an_order_shipped_once(
    database_url: str, postgres_server, bootstrap_servers: str, make_topic, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    shop = database_url
    name = f"fulfilment_{uuid.uuid4().hex[:12]}"
    fulfilment = postgres_server.create_database(name)
    try:
        walk_the_guide(shop, fulfilment, bootstrap_servers, make_topic, tmp_path)
    finally:
        postgres_server.drop_database(name)


def walk_the_guide(shop: str, fulfilment: str, bootstrap: str, make_topic, tmp: Path) -> None:  # type: ignore[no-untyped-def]
    on_shop = {"OUTBOX_DATABASE_URL": shop}
    ini = "examples/fastapi_service/alembic.ini"

    # Step 2: one history. The old habit fails loudly; `heads` applies both branches.
    refused = command("alembic", "-c", ini, "upgrade", "head", env=on_shop, check=False)
    assert refused.returncode != 0
    assert "Multiple head revisions" in refused.stdout + refused.stderr
    command(*documented(f"alembic -c {ini} upgrade heads").split(), env=on_shop)
    assert {"customers", "orders", "outbox"} <= tables(shop)
    heads = command("alembic", "-c", ini, "heads", env=on_shop).stdout
    assert "(app)" in heads and "(outbox)" in heads, heads
    # What to check: autogenerate sees the models and the outbox table as they are.
    checked = command(*documented(f"alembic -c {ini} check").split(), env=on_shop)
    assert "No new upgrade operations detected" in checked.stdout + checked.stderr

    # Step 4: the topic (made with a name of its own for the test, deleted after it), and the
    # guide's check of it.
    topic = make_topic("orders", partitions=3)
    env = {**on_shop, "ORDERS_TOPIC": topic, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": bootstrap}
    check = documented("outbox topics check orders").replace("orders", topic).split()
    lines = command(*check, env=env).stdout.splitlines()
    assert any(line.startswith(topic) and " ok " in line for line in lines), lines

    # Step 6: the consuming service's tables and its inbox.
    on_fulfilment = {**env, "OUTBOX_DATABASE_URL": fulfilment}
    command("python", "-m", "examples.fastapi_service.fulfilment", env=on_fulfilment)
    command(*documented("outbox inbox install").split(), env=on_fulfilment)
    assert {"shipments", "inbox", "inbox_parked"} <= tables(fulfilment)

    relay_port, consumer_port = free_port(), free_port()
    relay_args = ["relay", "--metrics-port", str(relay_port), "--poll-interval", "0.2"]
    consume_args = [
        *documented("consume examples.fastapi_service.fulfilment:inbox").split(),
        "--metrics-port",
        str(consumer_port),
    ]
    with (
        serving(shop, topic, tmp / "uvicorn.log") as base,
        daemon(relay_args, env, tmp / "relay.log"),
        daemon(consume_args, on_fulfilment, tmp / "consume.log"),
    ):
        wait_for(lambda: ready(relay_port) and ready(consumer_port), 90, "relay and consumer")
        customer = create_customer(base, "100.00")
        placed = []
        for quantity in (1, 2, 3):
            response = httpx.post(
                f"{base}/orders",
                json={"customer_id": customer, "lines": [line(quantity=quantity)]},
                timeout=30,
            )
            assert response.status_code == 201, response.text
            placed.append(response.json())
        # 12.50 x 6 spent: this one would overdraw, so neither the order nor its message exist.
        refused_order = httpx.post(
            f"{base}/orders",
            json={"customer_id": customer, "lines": [line(quantity=3)]},
            timeout=30,
        )
        assert refused_order.status_code == 409, refused_order.text

        # Step 5 and 6, what to check: every message sent; every order shipped, once.
        shop_engine, fulfilment_engine = sa.create_engine(shop), sa.create_engine(fulfilment)
        try:

            def shipped() -> dict[uuid.UUID, int]:
                with fulfilment_engine.connect() as conn:
                    rows = conn.execute(sa.text("SELECT order_id, items FROM shipments"))
                    return {row.order_id: row.items for row in rows}

            wait_for(lambda: len(shipped()) == 3, 90, "the three orders shipped")
            final = shipped()
            with shop_engine.connect() as conn:
                outbox_rows = conn.execute(sa.text("SELECT status, value FROM outbox")).all()
            with fulfilment_engine.connect() as conn:
                applied = conn.execute(sa.text("SELECT count(*) FROM inbox")).scalar()
            # Step 3's check query shows each message's key and value as text.
            query = documented(
                "SELECT status, topic, convert_from(key, 'UTF8') AS key, "
                "convert_from(value, 'UTF8') AS value\n  FROM outbox;"
            )
            with shop_engine.connect() as conn:
                shown = conn.execute(sa.text(query)).all()
        finally:
            shop_engine.dispose()
            fulfilment_engine.dispose()
    assert [status for status, _ in outbox_rows] == ["sent"] * 3
    events = {json.loads(value)["order_id"] for _, value in outbox_rows}
    assert events == {p["order_id"] for p in placed}
    # The orders were for 1, 2 and 3 items, in that order.
    assert {str(k): v for k, v in final.items()} == {
        p["order_id"]: n for n, p in enumerate(placed, start=1)
    }
    assert applied == 3
    assert sorted((row.key, json.loads(row.value)["order_id"]) for row in shown) == sorted(
        (p["order_id"], p["order_id"]) for p in placed
    )

    # Step 7: the audit, now, over the last hour: nothing missing, duplicated or stuck.
    audit = command(
        *documented("outbox reconcile --since 1h").split(),
        *("--topic", topic, "--output", str(tmp / "audit"), "--master", "local[2]"),
        *("--jdbc-slices", "2", "--json"),
        env=env,
        check=False,
    )
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
    summary = json.loads(audit.stdout.strip().splitlines()[-1])
    assert set(summary["discrepancies"].values()) == {0}, summary


def test_the_merge_way_keeps_one_head_until_the_outbox_adds_a_revision(
    database_url: str, tmp_path: Path
) -> None:
    # A copy of the example's Alembic set-up, so that the merge revision is written there.
    service = tmp_path / "service"
    service.mkdir()
    shutil.copy(EXAMPLE / "alembic.ini", service / "alembic.ini")
    shutil.copytree(EXAMPLE / "migrations", service / "migrations")
    ini = str(service / "alembic.ini")
    env = {"OUTBOX_DATABASE_URL": database_url}
    versions = service / "migrations" / "versions"
    before = set(versions.glob("*.py"))

    merge = documented('alembic merge app@head outbox@head -m "join the outbox history"')
    command("alembic", "-c", ini, *merge.split()[1:4], "-m", "join the outbox history", env=env)
    (merged,) = set(versions.glob("*.py")) - before  # in the service's folder, not the package's
    assert "outbox" in merged.read_text()
    heads = command("alembic", "-c", ini, "heads", env=env).stdout.strip().splitlines()
    assert len(heads) == 1, heads
    command("alembic", "-c", ini, "upgrade", "head", env=env)  # the old habit works again
    assert {"customers", "orders", "outbox"} <= tables(database_url)

    # A new revision of the service's stacks on the merge, in the service's folder.
    command("alembic", "-c", ini, "revision", "-m", "add email", env=env)
    assert len(set(versions.glob("*.py")) - before) == 2
    assert len(command("alembic", "-c", ini, "heads", env=env).stdout.strip().splitlines()) == 1


def test_a_label_on_an_applied_first_revision_joins_the_histories(
    database_url: str, tmp_path: Path
) -> None:
    """A service whose history had no branch label and is applied already: the guide's edit
    of its first revision, then `alembic upgrade heads`, adds the outbox and re-runs nothing."""
    service = tmp_path / "service"
    service.mkdir()
    shutil.copytree(EXAMPLE / "migrations", service / "migrations")
    (first,) = (service / "migrations" / "versions").glob("*app_0001*.py")
    labelled = documented('branch_labels = ("app",)')
    first.write_text(first.read_text().replace(labelled, "branch_labels = None"))
    ini = (EXAMPLE / "alembic.ini").read_text()
    alone = ini.replace(" outbox.migrations:versions", "")  # before the outbox: one history
    (service / "alembic.ini").write_text(alone)
    env = {"OUTBOX_DATABASE_URL": database_url}
    config = str(service / "alembic.ini")
    command("alembic", "-c", config, "upgrade", "head", env=env)
    assert "outbox" not in tables(database_url) and "orders" in tables(database_url)

    # The guide's two edits: the outbox's revisions listed, the first revision labelled.
    documented("Edit that file, already applied or not, and change its line to")
    (service / "alembic.ini").write_text(ini)
    first.write_text(first.read_text().replace("branch_labels = None", labelled))
    command("alembic", "-c", config, "upgrade", "heads", env=env)
    assert {"outbox", "orders", "customers"} <= tables(database_url)
    current = command("alembic", "-c", config, "current", env=env).stdout
    assert "app_0001 (head)" in current, current  # applied once, not again
    heads = command("alembic", "-c", config, "heads", env=env).stdout
    assert documented("app_0001 (app) (head)") in heads and "(outbox) (head)" in heads, heads
