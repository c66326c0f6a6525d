"""The outbox's Alembic history: one head, a clean round trip, and DDL equal to the model."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner

from outbox import migrate
from outbox.cli import main
from outbox.migration_support import alembic_config
from outbox.schema import OutboxTableSpec

pytestmark = pytest.mark.integration


def table_names(url: str, schema: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names(schema=schema))
    finally:
        engine.dispose()


def test_history_has_a_single_head() -> None:
    script = ScriptDirectory.from_config(alembic_config("postgresql://unused"))
    assert len(script.get_heads()) == 1


def test_upgrade_downgrade_round_trip_step_by_step(database_url: str) -> None:
    script = ScriptDirectory.from_config(alembic_config(database_url))
    revisions = [r.revision for r in reversed(list(script.walk_revisions()))]
    for revision in revisions:
        migrate.upgrade(database_url, revision=revision)
    assert {"outbox", "outbox_alembic_version"} <= table_names(database_url, "public")
    for revision in reversed(revisions[:-1]):
        migrate.downgrade(database_url, revision=revision)
    migrate.downgrade(database_url, revision="base")
    assert "outbox" not in table_names(database_url, "public")
    migrate.upgrade(database_url)  # and up again from nothing
    assert "outbox" in table_names(database_url, "public")


@pytest.mark.parametrize("spec", [OutboxTableSpec(), OutboxTableSpec("messaging", "events_out")])
def test_migrated_schema_matches_the_declared_table(
    database_url: str, spec: OutboxTableSpec
) -> None:
    migrate.upgrade(database_url, spec)
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "include_schemas": True,
                    "include_object": lambda obj, name, type_, *_: (
                        type_ != "table" or name == spec.table
                    ),
                },
            )
            spec.table_obj  # noqa: B018 - declare it on the spec's metadata
            assert compare_metadata(context, spec.metadata) == []
    finally:
        engine.dispose()


def test_cli_upgrades_a_custom_schema_and_table(database_url: str) -> None:
    result = CliRunner().invoke(
        main,
        ["db", "upgrade", "--database-url", database_url, "--schema", "msg", "--table", "out"],
    )
    assert result.exit_code == 0, result.output
    assert {"out", "out_alembic_version"} <= table_names(database_url, "msg")

    offline = CliRunner().invoke(main, ["db", "upgrade", "--database-url", database_url, "--sql"])
    assert offline.exit_code == 0
    assert "CREATE TABLE public.outbox" in offline.output
    assert 'DO ALSO NOTIFY "outbox_public_outbox"' in offline.output


@pytest.mark.parametrize("bad", ["Outbox", "out;drop", "1abc", "a" * 64])
def test_cli_refuses_a_table_name_that_is_not_a_plain_identifier(
    database_url: str, bad: str
) -> None:
    result = CliRunner().invoke(
        main, ["db", "upgrade", "--database-url", database_url, "--table", bad]
    )
    assert result.exit_code == 2
    assert "outbox table" in result.output
    assert "Traceback" not in result.output


def test_cli_reports_an_unreachable_database_in_one_line() -> None:
    url = "postgresql+psycopg://app:secret-pw@127.0.0.1:1/nowhere"
    result = CliRunner().invoke(main, ["db", "upgrade", "--database-url", url])
    assert result.exit_code == 2
    assert result.output.startswith("Error: database error:")
    assert "secret-pw" not in result.output


def db(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["db", *args])
    return result.exit_code, result.output


def test_cli_current_names_the_revision_or_says_there_is_no_table(database_url: str) -> None:
    code, output = db("current", "--database-url", database_url)
    assert (code, output) == (0, "public.outbox does not exist yet: run `outbox db upgrade`\n")
    assert "outbox_alembic_version" not in table_names(database_url, "public")

    # A second outbox table's own record is not mistaken for another history of the first.
    migrate.upgrade(database_url, OutboxTableSpec("public", "events_out"))
    migrate.upgrade(database_url)
    (head,) = ScriptDirectory.from_config(alembic_config(database_url)).get_heads()
    for table in ("outbox", "events_out"):
        assert db("current", "--database-url", database_url, "--table", table) == (
            0,
            f"{head} (head)\n",
        )


def test_cli_upgrade_says_what_it_did(database_url: str) -> None:
    head = ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
    code, output = db("upgrade", "--database-url", database_url, "--revision", "0001_create_outbox")
    assert (code, output.splitlines()[-1]) == (
        0,
        "public.outbox upgraded from nothing to 0001_create_outbox",
    )
    code, output = db("upgrade", "--database-url", database_url)
    assert (code, output.splitlines()[-1]) == (
        0,
        f"public.outbox upgraded from 0001_create_outbox to {head}",
    )
    code, output = db("upgrade", "--database-url", database_url)
    assert (code, output.splitlines()[-1]) == (
        0,
        f"public.outbox is already at {head}: nothing to do",
    )


def test_cli_refuses_to_upgrade_a_table_no_history_records(database_url: str) -> None:
    spec = OutboxTableSpec()
    engine = sa.create_engine(database_url)
    try:
        spec.metadata.create_all(engine, tables=[spec.table_obj])
    finally:
        engine.dispose()
    code, output = db("upgrade", "--database-url", database_url)
    assert code == 2
    assert "public.outbox exists but no Alembic version table records its revision" in output
    assert "outbox_alembic_version" not in table_names(database_url, "public")
    code, output = db("current", "--database-url", database_url)
    assert code == 0
    assert "no Alembic version table records its revision" in output


def test_the_inbox_history_is_a_branch_of_its_own_installed_on_demand(database_url: str) -> None:
    from outbox.inbox import InboxTableSpec
    from outbox.inbox import migrate as inbox_migrate

    script = ScriptDirectory.from_config(inbox_migrate.alembic_config(database_url))
    [head] = script.get_heads()
    assert head == "inbox_0001" and script.get_revision(head).branch_labels == {"inbox"}
    migrate.upgrade(database_url)
    assert "inbox" not in table_names(database_url, "public")  # opt-in: not with the outbox
    spec = InboxTableSpec("consumer", "received")
    inbox_migrate.install(database_url, spec)
    assert {"received", "received_parked", "received_alembic_version"} <= table_names(
        database_url, "consumer"
    )
    assert inbox_migrate.revision_of(database_url, spec) == "inbox_0001"
    migrate.upgrade(database_url)  # the outbox's own history is untouched by the inbox's
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "include_schemas": True,
                    "include_object": lambda obj, name, type_, *_: (
                        type_ != "table" or name in ("received", "received_parked")
                    ),
                },
            )
            spec.inbox  # noqa: B018 - declare both tables on the spec's metadata
            spec.parked  # noqa: B018
            assert compare_metadata(context, spec.metadata) == []
    finally:
        engine.dispose()
    inbox_migrate.uninstall(database_url, spec)
    assert "received" not in table_names(database_url, "consumer")
    assert "outbox" in table_names(database_url, "public")


def test_revision_0004_holds_the_exclusive_lock_only_for_its_short_alter(
    database_url: str,
) -> None:
    migrate.upgrade(database_url, revision="0003_wake_trigger")
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as reader:  # a long transaction that read the table
            reader.execute(sa.text("SELECT count(*) FROM outbox")).scalar()
            with pytest.raises(Exception, match="stayed locked by another transaction") as failed:
                migrate.upgrade(database_url)
            reader.rollback()
        assert "nothing was changed" in str(failed.value)
        assert migrate_current(engine) == "0003_wake_trigger"
        migrate.upgrade(database_url)
        with engine.connect() as conn:
            valid = conn.execute(
                sa.text(
                    "SELECT c.convalidated, i.indisvalid FROM pg_constraint c, pg_index i "
                    "WHERE c.conname = 'outbox_status_check' "
                    "AND i.indexrelid = 'outbox_prepared_idx'::regclass"
                )
            ).one()
        assert tuple(valid) == (True, True)
    finally:
        engine.dispose()
    # The scans run after the commit of the ALTER, outside any transaction.
    script = (
        CliRunner()
        .invoke(
            main,
            ["db", "upgrade", "--database-url", database_url, "--sql"],
        )
        .output
    )
    part = script[script.index("0004") :]
    alter, commit = part.index("lock_timeout"), part.index("COMMIT")
    assert alter < commit < part.index("VALIDATE CONSTRAINT")
    assert commit < part.index("CREATE INDEX CONCURRENTLY")


@pytest.mark.parametrize("direction", ["upgrade", "downgrade"])
@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("0002_generation_retry_idx", "0003_wake_trigger"),
        ("0004_prepared_messages", "0005_wake_before_insert"),
        ("0005_wake_before_insert", "0006_wake_lock_in_condition"),
        ("0006_wake_lock_in_condition", "0007_check_failures"),
    ],
)
def test_a_wake_revision_waits_a_bounded_time_for_an_open_transaction(
    database_url: str, direction: str, before: str, after: str
) -> None:
    migrate.upgrade(database_url, revision=before if direction == "upgrade" else after)
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as writer:  # inserted, and left open
            writer.execute(
                sa.text(
                    "INSERT INTO outbox (id, shard, topic, value) "
                    "VALUES (gen_random_uuid(), 0, 't', 'v')"
                )
            )
            with pytest.raises(Exception, match="stayed locked by another transaction") as failed:
                if direction == "upgrade":
                    migrate.upgrade(database_url, revision=after)
                else:
                    migrate.downgrade(database_url, revision=before)
            writer.rollback()
        assert "nothing was changed" in str(failed.value)
        assert migrate_current(engine) == (before if direction == "upgrade" else after)
    finally:
        engine.dispose()


def migrate_current(engine: sa.Engine) -> str:
    with engine.connect() as conn:
        return str(conn.execute(sa.text("SELECT version_num FROM outbox_alembic_version")).scalar())


def test_downgrade_past_0004_refuses_messages_without_a_verdict(database_url: str) -> None:
    migrate.upgrade(database_url)
    engine = sa.create_engine(database_url)
    try:
        with engine.begin() as conn:  # left dead by check-back (--on-max-checks dead)
            conn.execute(
                sa.text(
                    "INSERT INTO outbox (id, shard, topic, value, status, error_kind, "
                    "prepared_at, check_group) VALUES (gen_random_uuid(), 0, 'orders', 'x', "
                    "'dead', 'unresolved', now(), 'orders')"
                )
            )
        with pytest.raises(Exception, match="left dead without a verdict"):
            migrate.downgrade(database_url, revision="0003_wake_trigger")
        assert migrate_current(engine) == "0011_released_idempotency_keys"  # nothing came down
        with engine.connect() as conn:  # (the lease index with it)
            assert conn.execute(sa.text("SELECT to_regclass('outbox_lease_idx')")).scalar()
    finally:
        engine.dispose()


def wake_trigger_timing(engine: sa.Engine) -> str:
    with engine.connect() as conn:
        tgtype = conn.execute(
            sa.text("SELECT tgtype FROM pg_trigger WHERE tgname = 'outbox_wake'")
        ).scalar_one()
    return "BEFORE" if tgtype & 2 else "AFTER"  # TRIGGER_TYPE_BEFORE


@pytest.mark.parametrize(
    "revision",
    ["0004_prepared_messages", "0005_wake_before_insert", "0006_wake_lock_in_condition"],
)
def test_writers_notify_only_while_the_wake_lock_is_held_with_each_trigger(
    database_url: str, revision: str
) -> None:
    migrate.upgrade(database_url)
    if revision != "0006_wake_lock_in_condition":
        migrate.downgrade(database_url, revision=revision)
    engine = sa.create_engine(database_url)
    spec = OutboxTableSpec()
    insert = sa.text(
        "INSERT INTO outbox (id, shard, topic, value) VALUES (gen_random_uuid(), 0, 't', 'v')"
    )
    try:
        assert wake_trigger_timing(engine) == ("AFTER" if revision.startswith("0004") else "BEFORE")
        with engine.connect() as relay:
            relay.execute(sa.text(f'LISTEN "{spec.notify_channel}"'))
            relay.commit()
            raw = relay.connection.driver_connection
            assert raw is not None
            with engine.begin() as writer:  # no relay asleep
                writer.execute(insert)
                # The writer holds the wake lock shared until it commits: no relay can fall
                # asleep (take it exclusively) while a commit that did not notify is pending.
                taken = relay.execute(
                    sa.text("SELECT pg_try_advisory_lock(:a, :b)"),
                    dict(zip("ab", spec.wake_lock, strict=True)),
                ).scalar_one()
                relay.commit()
                assert taken is False
            assert list(raw.notifies(timeout=0.3)) == []
            relay.execute(
                sa.text("SELECT pg_advisory_lock(:a, :b)"),
                dict(zip("ab", spec.wake_lock, strict=True)),
            )
            relay.commit()
            with engine.begin() as writer:  # a relay asleep: the writer notifies at commit
                writer.execute(insert)
            assert [n.channel for n in raw.notifies(timeout=5, stop_after=1)] == [
                spec.notify_channel
            ]
    finally:
        engine.dispose()
