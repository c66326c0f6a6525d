"""`outbox dashboard` in a real browser: Debian's headless Chromium, driven by Selenium
through Debian's chromedriver, against the real PostgreSQL, Kafka, relay and consumer.

OUTBOX_DASHBOARD_SCREENSHOT=docs/img/dashboard-overview.png saves the overview as the first
test sees it (the picture in docs/dashboard.md).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox import Outbox
from outbox.cli import main
from outbox.dashboard.app import Dashboard
from outbox.dashboard.guard import Guard
from outbox.dashboard.reads import Reads
from outbox.dashboard.server import serve_in_thread
from outbox.devstack import StackError
from outbox.devstack.browser import HEADLESS_FLAGS, Chromium, chromium
from outbox.devstack.topics import create_topics
from outbox.inbox.schema import InboxTableSpec
from outbox.prepared import PreparedMessages, StepAbandoned
from outbox.queries import Queries
from outbox.schema import SHARD_COUNT, OutboxTableSpec
from tests import prepared_app
from tests.conftest import server_unavailable
from tests.inbox_app import make_inbox
from tests.inbox_helpers import consumer_config, prepare_database, produce, running_consumer
from tests.relay_helpers import relay_config, running_relay, wait_for

pytestmark = pytest.mark.integration

TOKEN = "correct-horse-battery-staple"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def chromium_install() -> Chromium:
    try:
        return chromium()
    except StackError as exc:
        server_unavailable("Chromium", exc)
        raise


@pytest.fixture
def browser(chromium_install: Chromium, tmp_path: Path) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium_install.browser)
    for flag in HEADLESS_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.add_argument("--window-size=1360,1000")
    driver = webdriver.Chrome(
        service=Service(executable_path=str(chromium_install.driver)), options=options
    )
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@contextmanager
def serving(url: str, token: str | None = TOKEN, refresh: float = 0, **reads: Any) -> Iterator[str]:
    """The dashboard on a free loopback port for the block (reads with no cache); its
    address."""
    engine = sa.create_engine(url, pool_pre_ping=True)
    found = Reads(
        engine, Queries(OutboxTableSpec()), engine, InboxTableSpec(), scan_interval=0, **reads
    )
    server = serve_in_thread(Dashboard(found, Guard(token), refresh=refresh), "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        engine.dispose()


def log_in(driver: Any, base: str, then: str = "/") -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"{base}/login?{urlencode({'next': then})}")
    driver.find_element(By.ID, "token").send_keys(TOKEN)
    driver.find_element(By.ID, "log-in").click()
    until(driver, lambda d: d.find_elements(By.ID, "logout"), "the login")


def until(driver: Any, check: Callable[[Any], Any], what: str, timeout: float = 30) -> Any:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    # A page that refreshes itself replaces its elements under the check (stale elements,
    # nodes gone from the document): look again.
    ignored = (WebDriverException,)
    wait = WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=ignored)
    return wait.until(check, f"waited for {what}")


def note(driver: Any) -> str:
    """The note of the page an action led back to (a click on a form's button returns
    before the browser has the next page)."""
    from selenium.webdriver.common.by import By

    found = until(driver, lambda d: d.find_element(By.CSS_SELECTOR, "p.note"), "the note")
    return str(found.text)


def acted(driver: Any, button: Any) -> str:
    """Click an action's button; the note of the page it leads back to, not the one of the
    page it was on (which is still there as the click returns)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.expected_conditions import staleness_of

    page = driver.find_element(By.TAG_NAME, "html")
    button.click()
    until(driver, staleness_of(page), "the page the action leads back to")
    return note(driver)


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def test_dead_messages_of_a_missing_topic_are_grouped_and_a_retry_sends_them_once_it_exists(  # type: ignore[no-untyped-def]
    outbox_url, engine, bootstrap_servers, browser
) -> None:
    from selenium.webdriver.common.by import By

    missing = f"later-{uuid.uuid4().hex[:8]}"
    with Outbox(engine).transaction() as tx:
        ids = [tx.publish(missing, {"n": n}, key=f"k{n}").message_id for n in range(3)]
    # A prepared message waiting for its verdict, beside them.
    PreparedMessages(Outbox(engine), group="payments", check_after=3600).prepare("orders", {})

    def dead() -> int:
        return int(scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'dead'"))

    with (
        running_relay(relay_config(outbox_url, bootstrap_servers)),
        serving(outbox_url, refresh=1) as base,
    ):
        browser.get(base + "/")
        until(browser, lambda d: d.find_element(By.ID, "login").text == "Log in to act", "login")
        wait_for(lambda: dead() == 3, 30, "the relay to mark the missing topic's messages dead")
        # The overview refreshes itself (no reload from here) until paused.
        until(browser, lambda d: '<a href="/dead">3</a>' in d.page_source, "3 dead on the page")
        assert '<a href="/?refresh=off">pause</a>' in browser.page_source
        browser.get(base + "/?refresh=off")
        assert browser.find_elements(By.CSS_SELECTOR, "meta[http-equiv='refresh']") == []
        row = browser.find_element(By.XPATH, f"//table[@id='topics']//td[text()='{missing}']/..")
        assert row.find_elements(By.TAG_NAME, "td")[5].text == "3"  # DEAD
        groups = browser.find_elements(By.CSS_SELECTOR, "#prepared-groups tbody td")
        assert [td.text for td in groups][:2] == ["payments", "1"]
        relays = browser.find_elements(By.CSS_SELECTOR, "#relays tbody tr")
        assert (
            len(relays) == 1
            and relays[0].find_elements(By.TAG_NAME, "td")[5].text == f"0-{SHARD_COUNT - 1}"
        )
        if os.environ.get("OUTBOX_DASHBOARD_SCREENSHOT"):
            browser.save_screenshot(os.environ["OUTBOX_DASHBOARD_SCREENSHOT"])

        log_in(browser, base, "/dead?refresh=off")
        causes = browser.find_elements(By.CSS_SELECTOR, "section.cause")
        assert len(causes) == 1
        head = causes[0].find_element(By.CSS_SELECTOR, ".cause-head").text
        # The fingerprint of `outbox dead list --by-reason`.
        by_reason = ["dead", "list", "--by-reason", "--database-url", outbox_url]
        listed = CliRunner().invoke(main, by_reason)
        line = next(line for line in listed.output.splitlines() if "unknown_topic:" in line)
        assert head.split()[:3] == [line.split()[0], "3", "unknown_topic:"]
        assert len(causes[0].find_elements(By.CSS_SELECTOR, "table.messages tbody tr")) == 3

        create_topics(bootstrap_servers, [missing])
        causes[0].find_element(By.CSS_SELECTOR, "button.retry-cause").click()
        assert note(browser) == "requeued 3 dead message(s)"

        def sent() -> bool:
            count = "SELECT count(*) FROM outbox WHERE status = 'sent' AND topic = :t"
            return bool(scalar(engine, count, t=missing) == 3)

        wait_for(sent, 60, "the retried messages to be sent")
        browser.get(base + "/dead")
        assert browser.find_element(By.ID, "no-dead").text == "No dead messages."
        browser.get(base + "/?refresh=off")
        row = browser.find_element(By.XPATH, f"//table[@id='topics']//td[text()='{missing}']/..")
        cells = [td.text for td in row.find_elements(By.TAG_NAME, "td")]
        assert (cells[4], cells[5]) == ("3", "0")  # SENT LAST HOUR, DEAD
        browser.get(f"{base}/message?id={ids[1]}")
        assert browser.find_element(By.ID, "status").text == "sent"
        offset = scalar(engine, "SELECT kafka_offset FROM outbox WHERE id = :i", i=ids[1])
        assert browser.find_element(By.ID, "landed").text == f"{missing}[0]@{offset}"


def test_a_parked_message_is_retried_and_applied(  # type: ignore[no-untyped-def]
    outbox_url, bootstrap_servers, make_topic, browser
) -> None:
    from selenium.webdriver.common.by import By

    topic, group = make_topic("parked"), f"billing-{uuid.uuid4().hex[:6]}"
    engine = prepare_database(outbox_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO fail_plan VALUES (7, 100)"))
        config = consumer_config(outbox_url, bootstrap_servers, max_attempts=1)
        kafka = {"bootstrap.servers": bootstrap_servers}
        with (
            running_consumer(make_inbox([topic], group), config),
            serving(outbox_url, kafka=kafka) as base,
        ):
            produce(bootstrap_servers, topic, [7], extra={7: {"fail": True}})

            def parked() -> bool:
                return bool(scalar(engine, "SELECT count(*) FROM inbox_parked") == 1)

            wait_for(parked, 60, "the consumer to park the failing message")
            log_in(browser, base, "/parked")
            cause = browser.find_element(By.CSS_SELECTOR, "section.cause")
            head = cause.find_element(By.CSS_SELECTOR, ".cause-head").text
            assert "1 handler/tests.inbox_app.PlannedFailure:" in head
            summary = cause.find_element(By.CSS_SELECTOR, "table.messages details summary")
            exception = "tests.inbox_app.PlannedFailure: planned failure of n=7"
            assert summary.text == f"handler: {exception}"
            summary.click()  # the whole error, traceback and all
            whole = cause.find_element(By.CSS_SELECTOR, "pre.error-text").text
            assert whole.startswith(f"{exception}\nTraceback (most recent call last):")
            assert whole.endswith('raise PlannedFailure(f"planned failure of n={n}")')

            with engine.begin() as conn:
                conn.execute(sa.text("DELETE FROM fail_plan"))
            cause.find_element(By.CSS_SELECTOR, "button.retry-one").click()
            assert note(browser).startswith("requeued 1 parked message(s)")

            def applied() -> bool:
                return bool(scalar(engine, "SELECT count(*) FROM ledger WHERE n = 7") == 1)

            wait_for(applied, 60, "the consumer to apply the retried message")
            wait_for(lambda: not parked(), 30, "the parked row to go")
            browser.get(base + "/parked")
            assert browser.find_element(By.ID, "no-parked").is_displayed()

            def consumers(driver: Any) -> list[list[str]]:
                driver.get(base + "/")
                rows = driver.find_elements(By.CSS_SELECTOR, "#consumers tbody tr")
                return [[td.text for td in row.find_elements(By.TAG_NAME, "td")] for row in rows]

            # group, parked, handed back, oldest parked, lag (Kafka's committed offsets).
            until(browser, lambda d: consumers(d) == [[group, "0", "0", "-", "0"]], "no lag")
    finally:
        engine.dispose()


def test_a_prepared_message_is_committed_and_another_rolled_back_only_on_the_operators_word(  # type: ignore[no-untyped-def]
    outbox_url, engine, bootstrap_servers, make_topic, browser
) -> None:
    from selenium.webdriver.common.by import By

    topic = make_topic("prepared")
    prepared = PreparedMessages(Outbox(engine), group="payments", check_after=3600)
    kept = prepared.prepare(topic, {"charge": 1}, key="order-1").message_id
    dropped = prepared.prepare(topic, {"charge": 2}, key="order-2").message_id

    def status(message_id: uuid.UUID) -> str:
        return str(scalar(engine, "SELECT status FROM outbox WHERE id = :i", i=message_id))

    # What `outbox prepared rollback ID` says without --checker or --step-cannot-happen.
    by_hand = CliRunner().invoke(
        main, ["prepared", "rollback", str(dropped), "--database-url", outbox_url]
    )
    assert by_hand.exit_code == 2 and by_hand.output.startswith("Error: ")
    refusal = by_hand.output.removeprefix("Error: ").strip()
    assert "its step may still commit" in refusal
    with running_relay(relay_config(outbox_url, bootstrap_servers)), serving(outbox_url) as base:
        log_in(browser, base, "/prepared")
        rows = browser.find_elements(By.CSS_SELECTOR, "#prepared tbody tr")
        assert [r.find_element(By.TAG_NAME, "code").text for r in rows] == [str(kept), str(dropped)]
        rows[0].find_element(By.CSS_SELECTOR, "button.commit").click()
        assert note(browser) == f"committed {kept}: the relay publishes it"
        rows = browser.find_elements(By.CSS_SELECTOR, "#prepared tbody tr")
        assert len(rows) == 1
        # Without a checker and without the operator's word, the rollback is refused, as the
        # command refuses it.
        assert acted(browser, rows[0].find_element(By.CSS_SELECTOR, "button.rollback")) == (
            f"nothing done: {refusal}"
        )
        assert status(dropped) == "prepared"
        rows = browser.find_elements(By.CSS_SELECTOR, "#prepared tbody tr")
        box = rows[0].find_element(By.CSS_SELECTOR, "input[name='step_cannot_happen']")
        box.click()
        assert box.is_selected()
        assert acted(browser, rows[0].find_element(By.CSS_SELECTOR, "button.rollback")) == (
            f"rolled back {dropped} on your word that its step cannot happen "
            "(`outbox prepared list --unblocked` lists it)"
        )
        assert browser.find_element(By.ID, "no-prepared").is_displayed()
        wait_for(lambda: status(kept) == "sent", 30, "the committed message to be sent")
        assert status(dropped) == "rolled_back"
        for message_id in (kept, dropped):
            resolved = scalar(engine, "SELECT resolved_by FROM outbox WHERE id = :i", i=message_id)
            assert resolved == "operator"
    unblocked = ["prepared", "list", "--unblocked", "--database-url", outbox_url]
    assert str(dropped) in CliRunner().invoke(main, unblocked).output


@pytest.fixture
def orders_url(database_url: str) -> Iterator[str]:
    """The order service's database (tests.prepared_app), which its checkers read."""
    prepared_app.create_orders_table(database_url).dispose()
    yield database_url


@contextmanager
def command_serving(outbox_url: str, *options: str, **env: str) -> Iterator[tuple[str, str]]:
    """``outbox dashboard`` in a process of its own, started from the project's directory
    with the token and ``options``: its address and the mode it printed."""
    environment = {
        **os.environ, "OUTBOX_DATABASE_URL": outbox_url, "OUTBOX_DASHBOARD_TOKEN": TOKEN, **env
    }  # fmt: skip
    command = [sys.executable, "-m", "outbox.cli", "dashboard", "--port", "0", *options]
    with subprocess.Popen(
        command, env=environment, cwd=ROOT, stdout=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline().strip()
            found = re.fullmatch(r"outbox dashboard on http://(127\.0\.0\.1:\d+)/ \((.+)\)", line)
            assert found is not None, line
            yield f"http://{found.group(1)}", found.group(2)
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(30)
    assert code == 0


def test_a_dashboard_with_the_checkers_rolls_back_what_its_checker_blocked_and_says_why_not(  # type: ignore[no-untyped-def]
    outbox_url, engine, orders_url, browser
) -> None:
    from selenium.webdriver.common.by import By

    orders = sa.create_engine(orders_url)
    prepared = PreparedMessages(Outbox(engine), group=prepared_app.GROUP, check_after=3600)

    def order_message(order_id: int) -> uuid.UUID:
        body = {"type": "OrderCreated", "order_id": order_id}
        return prepared.prepare("orders", body, key=order_id).message_id

    abandoned, placed, running = order_message(901), order_message(902), order_message(903)
    prepared_app.place_order(orders, 902, placed)  # this step happened: no rollback

    def status(message_id: uuid.UUID) -> str:
        return str(scalar(engine, "SELECT status FROM outbox WHERE id = :i", i=message_id))

    def roll_back(message_id: uuid.UUID) -> str:
        browser.get(f"{base}/message?{urlencode({'id': message_id})}")
        form = browser.find_element(By.CSS_SELECTOR, "form[action='/prepared/rollback']")
        # Nothing to tick: the checker decides, not the operator.
        assert form.find_elements(By.CSS_SELECTOR, "input[type='checkbox']") == []
        form.find_element(By.CSS_SELECTOR, "button.rollback").click()
        return note(browser)

    try:
        with command_serving(
            outbox_url,
            "--checker",
            "tests.prepared_app:registry",
            ORDERS_DATABASE_URL=orders_url,
        ) as (base, mode):
            assert mode == "actions need the token; rollbacks ask tests.prepared_app:registry"
            log_in(browser, base, "/prepared")
            rules = browser.find_element(By.TAG_NAME, "main").text
            assert "Roll back asks the message's checker to decide" in rules
            assert browser.find_elements(By.CSS_SELECTOR, "input[name='step_cannot_happen']") == []
            assert roll_back(abandoned) == (
                f"rolled back {abandoned}: its checker blocked the step (ROLLBACK)"
            )
            assert roll_back(placed) == (
                f"{placed} was not rolled back: its checker answers COMMIT: the step happened "
                f"(check-back commits it, or `outbox prepared commit {placed}`)"
            )
            with orders.begin() as step:  # the step of order 903, its transaction still open
                prepared_app.STEPS.record(step, running)
                refused = roll_back(running)
            assert refused.startswith(
                f"{running} was not rolled back: its checker failed (StepInProgress"
            )
            # A forged box does not bypass the checkers.
            with httpx.Client(base_url=base) as client:
                client.post("/login", data={"token": TOKEN})
                csrf = re.search(r'name="csrf" value="([^"]+)"', client.get("/prepared").text)
                assert csrf is not None
                forged = client.post(
                    "/prepared/rollback",
                    data={"id": str(running), "step_cannot_happen": "1", "csrf": csrf.group(1)},
                    headers={"Origin": base},
                    follow_redirects=True,
                )
                both = "roll back through the checkers or say the steps cannot happen, not both"
                assert f"nothing done: {both}" in forged.text
        assert (status(abandoned), status(placed), status(running)) == (
            "rolled_back",
            "prepared",
            "prepared",
        )
        stored = scalar(engine, "SELECT last_check_answer FROM outbox WHERE id = :i", i=abandoned)
        assert stored == "rollback"
        # Its producer's step comes now: the checker blocked it before the rollback.
        with pytest.raises(StepAbandoned):
            prepared_app.place_order(orders, 901, abandoned)
        assert not prepared_app.order_exists(orders, 901)
    finally:
        orders.dispose()


def test_what_an_operator_rolled_back_is_committed_after_all_unless_a_retry_took_its_key(  # type: ignore[no-untyped-def]
    outbox_url, engine, browser
) -> None:
    from selenium.webdriver.common.by import By

    from outbox.prepared.decisions import decide
    from outbox.prepared.store import PreparedStore

    prepared = PreparedMessages(Outbox(engine), group="payments", check_after=3600)
    wrong = prepared.prepare("orders", {"charge": 3}, idempotency_key="charge-3").message_id
    retried = prepared.prepare("orders", {"charge": 4}, idempotency_key="charge-4").message_id
    with engine.begin() as conn:  # `outbox prepared rollback --step-cannot-happen`
        store = PreparedStore(OutboxTableSpec())
        decide(conn, store, commit=False, ids=[wrong, retried], step_cannot_happen=True)
    with Outbox(engine).transaction() as tx:  # the retry of charge 4, published
        holder = tx.publish("orders", {"charge": 4}, idempotency_key="charge-4").message_id
    with serving(outbox_url) as base:
        log_in(browser, base)
        browser.get(f"{base}/message?{urlencode({'id': retried})}")
        assert "An operator rolled it back" in browser.find_element(By.TAG_NAME, "main").text
        browser.find_element(By.CSS_SELECTOR, "button.commit").click()
        refused = note(browser)
        assert refused.startswith(f"{retried} was not committed: message {retried} gave its")
        assert f"message {holder} took it since" in refused
        browser.get(f"{base}/message?{urlencode({'id': wrong})}")
        browser.find_element(By.CSS_SELECTOR, "button.commit").click()
        assert note(browser) == f"committed {wrong}: the relay publishes it"
    assert scalar(engine, "SELECT status FROM outbox WHERE id = :i", i=wrong) == "pending"
    assert scalar(engine, "SELECT status FROM outbox WHERE id = :i", i=retried) == "rolled_back"


def seed_every_kind(url: str, engine: sa.Engine) -> dict[str, Any]:
    """A dead message, a prepared one and a parked inbox row: one of each thing the
    dashboard acts on."""
    prepare_database(url).dispose()
    with Outbox(engine).transaction() as tx:
        dead = tx.publish("orders", {"n": 1}, key="k").message_id
    prepared = PreparedMessages(Outbox(engine), check_after=3600).prepare("orders", {"n": 2})
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox SET status = 'dead', error_kind = 'too_large', "
                "last_error = 'Broker: Message size too large' WHERE id = :id"
            ),
            {"id": dead},
        )
        parked = conn.execute(
            sa.text(
                "INSERT INTO inbox_parked (consumer_group, topic, kafka_partition, "
                "kafka_offset, reason, error) VALUES ('g', 'orders', 0, 5, 'handler', "
                "'ValueError: bad') RETURNING id"
            )
        ).scalar_one()
    return {"dead": dead, "prepared": prepared.message_id, "parked": parked}


def states(engine: sa.Engine) -> tuple[Any, ...]:
    with engine.connect() as conn:
        outbox = conn.execute(sa.text("SELECT id, status FROM outbox ORDER BY id")).all()
        parked = conn.execute(sa.text("SELECT id, status FROM inbox_parked")).all()
    return tuple(outbox), tuple(parked)


def test_every_action_refuses_without_the_token(outbox_url, engine, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    seeded = seed_every_kind(outbox_url, engine)
    before = states(engine)
    actions = {
        "/dead/retry": {"id": str(seeded["dead"])},
        "/parked/retry": {"id": str(seeded["parked"])},
        "/prepared/commit": {"id": str(seeded["prepared"])},
        # Ticked: let through, it would roll the message back.
        "/prepared/rollback": {"id": str(seeded["prepared"]), "step_cannot_happen": "1"},
    }
    with serving(outbox_url) as base:
        # Not logged in: the pages show no action at all.
        for page in ("/dead", "/parked", "/prepared", f"/message?id={seeded['prepared']}"):
            browser.get(base + page)
            assert browser.find_elements(By.CSS_SELECTOR, "main form[method='post']") == []
            assert browser.find_element(By.ID, "login").is_displayed()
        with httpx.Client(base_url=base) as client:
            for path, form in actions.items():
                refused = client.post(path, data=form)
                assert refused.status_code == 403 and "log in" in refused.text, path
            wrong = client.post("/login", data={"token": "guess", "next": "/"})
            assert wrong.status_code == 403 and "outbox_dashboard" not in wrong.cookies
            assert client.post("/login", data={"token": TOKEN}).status_code == 303
            for path, form in actions.items():
                without = client.post(path, data=form)
                assert without.status_code == 403 and "CSRF" in without.text, path
                stale = client.post(path, data={**form, "csrf": "from-an-old-page"})
                assert stale.status_code == 403 and "CSRF" in stale.text, path
            page = client.get("/dead").text
            csrf = re.search(r'name="csrf" value="([^"]+)"', page)
            assert csrf is not None
            for path, form in actions.items():
                foreign = client.post(
                    path,
                    data={**form, "csrf": csrf.group(1)},
                    headers={"Origin": "http://evil.example"},
                )
                assert foreign.status_code == 403, path
        assert states(engine) == before
        # The same request from the dashboard's own page goes through (so the refusals
        # above were the guard's, not a broken action).
        with httpx.Client(base_url=base) as client:
            client.post("/login", data={"token": TOKEN})
            csrf = re.search(r'name="csrf" value="([^"]+)"', client.get("/dead").text)
            assert csrf is not None
            done = client.post(
                "/dead/retry",
                data={**actions["/dead/retry"], "csrf": csrf.group(1), "back": "/dead"},
                headers={"Origin": base},
            )
            assert done.status_code == 303 and done.headers["location"] == "/dead"
        assert scalar(engine, "SELECT status FROM outbox WHERE id = :i", i=seeded["dead"]) == (
            "pending"
        )

    before = states(engine)
    with serving(outbox_url, token=None) as base:
        browser.get(base + "/login")
        assert "read-only" in browser.find_element(By.ID, "read-only").text
        with httpx.Client(base_url=base) as client:
            assert client.post("/login", data={"token": TOKEN}).status_code == 403
            for path, form in actions.items():
                refused = client.post(path, data=form)
                assert refused.status_code == 403 and "read-only" in refused.text, path
    assert states(engine) == before


SCRIPT = "<script>document.title='owned'</script><img src=x onerror=\"document.title='owned'\">"


def test_a_value_holding_script_shows_as_text(outbox_url, engine, browser) -> None:  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By

    with Outbox(engine).transaction() as tx:
        message_id = tx.publish(
            "orders",
            {"note": SCRIPT},
            key="<b>key</b>",
            headers={"x-note": "<script>document.title='owned'</script>"},
        ).message_id
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox SET status = 'dead', error_kind = 'too_large', "
                "last_error = :error WHERE id = :id"
            ),
            {"id": message_id, "error": f"refused {SCRIPT}"},
        )
    with serving(outbox_url) as base:
        log_in(browser, base)
        for page in (f"/message?id={message_id}", "/dead"):
            browser.get(base + page)
            assert "owned" not in browser.title
            assert browser.find_elements(By.CSS_SELECTOR, "script, main img") == []
        browser.get(f"{base}/message?id={message_id}")
        assert (
            browser.find_element(By.ID, "value").text
            == '{"note":"' + SCRIPT.replace('"', '\\"') + '"}'
        )
        assert browser.find_element(By.ID, "key").text == "<b>key</b>"
        assert browser.find_element(By.ID, "last-error").text == f"refused {SCRIPT}"
        assert (
            "<script>document.title='owned'</script>" in browser.find_element(By.ID, "headers").text
        )
        assert browser.title.startswith("Message ")


def test_the_command_serves_on_loopback_prints_its_address_and_stops_on_sigterm(  # type: ignore[no-untyped-def]
    outbox_url,
) -> None:
    refused = CliRunner().invoke(
        main, ["dashboard", "--database-url", outbox_url, "--host", "0.0.0.0"]
    )
    assert refused.exit_code == 2 and "pass --allow-remote" in refused.output
    env = {**os.environ, "OUTBOX_DATABASE_URL": outbox_url, "OUTBOX_DASHBOARD_TOKEN": TOKEN}
    command = [sys.executable, "-m", "outbox.cli", "dashboard", "--port", "0"]
    with subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline().strip()
            pattern = r"outbox dashboard on (http://127\.0\.0\.1:\d+/) \((.+)\)"
            found = re.fullmatch(pattern, line)
            assert found is not None, line
            assert found.group(2) == "actions need the token"
            page = httpx.get(found.group(1), timeout=30)
            assert page.status_code == 200 and "<h1>Overview</h1>" in page.text
            assert TOKEN not in page.text
            password = str(sa.make_url(outbox_url).password)
            assert password not in page.text and "***" in page.text
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(30)
    assert code == 0
