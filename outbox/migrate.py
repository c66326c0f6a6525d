"""Running the outbox's Alembic history: what ``outbox db ...`` calls.

``outbox db`` records the outbox table's revision in ``<table>_alembic_version``. A service
may instead include the outbox revisions in its own Alembic history, which records them in
its own version table (``alembic_version``). Before touching a database these functions look
at where its outbox table's revision is recorded, so that a table managed by another history
gets a clear refusal (and ``current`` says where to look) rather than Alembic trying to create
the table again.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy.pool import NullPool

from outbox.alembic_histories import revision_of as revision_of
from outbox.alembic_histories import upgrade_and_report
from outbox.errors import OutboxError
from outbox.migration_support import PARTITIONED_ATTRIBUTE, alembic_config
from outbox.partition_layout import check_interval
from outbox.schema import OutboxTableSpec

# Every table with a ``version_num`` column is taken for an Alembic version table. One called
# ``<t>_alembic_version`` beside a table ``<t>`` is ``outbox db``'s own record for that (other)
# outbox table, not a joined history.
_VERSION_TABLES = sa.text(
    """
    SELECT n.nspname AS schema, c.relname AS name,
           has_table_privilege(c.oid, 'SELECT') AS readable,
           EXISTS (SELECT 1 FROM pg_class AS t
                    WHERE t.relnamespace = c.relnamespace AND t.relkind IN ('r', 'p')
                      AND t.relname || '_alembic_version' = c.relname) AS beside_its_table
      FROM pg_attribute AS a
      JOIN pg_class AS c ON c.oid = a.attrelid
      JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE a.attname = 'version_num' AND NOT a.attisdropped AND c.relkind IN ('r', 'p')
       AND n.nspname NOT IN ('pg_catalog', 'information_schema')
    """
)


@dataclass(frozen=True)
class Placement:
    """Whether the outbox table exists and which version tables record its revision."""

    spec: OutboxTableSpec
    table_exists: bool
    #: revisions in ``<table>_alembic_version`` (``outbox db``'s record)
    own: tuple[str, ...]
    #: other version tables (qualified name) that record outbox revisions: a joined history
    joined: dict[str, tuple[str, ...]]

    @property
    def managed_elsewhere(self) -> bool:
        return self.table_exists and bool(self.joined)

    def refusal(self) -> str | None:
        """Why ``outbox db upgrade/downgrade`` must not run here, or None when it may."""
        name = self.spec.qualified_name
        if self.managed_elsewhere and self.own:
            where = ", ".join(self.joined)
            return (
                f"{name} is recorded both in {self.spec.schema}.{self.spec.version_table} "
                f"(outbox db) and in {where} (another Alembic history); keep one record "
                "(see docs/migrations.md, 'Moving to your own history')"
            )
        if self.managed_elsewhere:
            where, revisions = next(iter(self.joined.items()))
            return (
                f"{name} is managed by another Alembic history: {where} records outbox "
                f"revision {', '.join(revisions)}. Upgrade it there with `alembic upgrade "
                "heads`, not with `outbox db`"
            )
        if self.table_exists and not self.own:
            return (
                f"{name} exists but no Alembic version table records its revision (was it made "
                "by metadata.create_all?); drop it and run `outbox db upgrade`, or record its "
                "revision with `alembic stamp` (see docs/migrations.md)"
            )
        return None


def locate(database_url: str, spec: OutboxTableSpec | None = None) -> Placement:
    """Look up where the database records the revision of the outbox table ``spec``."""
    spec = spec or OutboxTableSpec()
    known = _outbox_revisions(database_url, spec)
    engine = sa.create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            exists = conn.execute(
                sa.text("SELECT to_regclass(:name) IS NOT NULL"), {"name": spec.qualified_name}
            ).scalar_one()
            own: tuple[str, ...] = ()
            joined: dict[str, tuple[str, ...]] = {}
            for row in conn.execute(_VERSION_TABLES).all():
                if (row.schema, row.name) == (spec.schema, spec.version_table):
                    # Read even without the right to: the error names what is missing.
                    own = _read_versions(conn, row.schema, row.name)
                elif row.readable and not row.beside_its_table:
                    revisions = _read_versions(conn, row.schema, row.name)
                    found = tuple(r for r in revisions if r in known)
                    if found:
                        joined[f"{row.schema}.{row.name}"] = found
    finally:
        engine.dispose()
    return Placement(spec, bool(exists), own, joined)


def upgrade(
    database_url: str,
    spec: OutboxTableSpec | None = None,
    revision: str = "head",
    *,
    sql: bool = False,
    partitioned: str | None = None,
) -> None:
    """Create or upgrade the outbox table (``sql=True`` prints the SQL instead).

    ``partitioned`` (``"daily"`` or ``"hourly"``) gives a table that reaches revision
    ``0009_partitioned_layout`` in this run the partitioned layout (docs/retention.md).

    Raises :class:`~outbox.errors.OutboxError`, changing nothing, when the table is managed
    by another Alembic history (or by none).
    """
    config = alembic_config(database_url, spec)
    if partitioned is not None:
        config.attributes[PARTITIONED_ATTRIBUTE] = check_interval(partitioned)
    if sql:
        command.upgrade(config, revision, sql=True)
        return
    spec = spec or OutboxTableSpec()
    _refuse_unless_ours(database_url, spec)
    upgrade_and_report(config, database_url, spec, revision, spec.qualified_name)


def downgrade(
    database_url: str,
    spec: OutboxTableSpec | None = None,
    revision: str = "base",
    *,
    sql: bool = False,
) -> None:
    """Step the outbox schema back to ``revision`` (``base`` drops the table)."""
    if not sql:
        _refuse_unless_ours(database_url, spec)
    command.downgrade(alembic_config(database_url, spec), revision, sql=sql)


def current(database_url: str, spec: OutboxTableSpec | None = None) -> None:
    """Print the revision the database is at, and which history records it if not ours."""
    spec = spec or OutboxTableSpec()
    config = alembic_config(database_url, spec)
    placement = locate(database_url, spec)
    if placement.managed_elsewhere:
        heads = set(ScriptDirectory.from_config(config).get_heads())
        for where, revisions in placement.joined.items():
            for revision in revisions:
                config.print_stdout(f"{revision}{' (head)' if revision in heads else ''}")
            config.print_stdout(
                f"recorded in {where}: {spec.qualified_name} is managed by that Alembic "
                "history (upgrade it with `alembic upgrade heads` there), not by `outbox db`"
            )
        if placement.own:
            config.print_stdout(f"and also in {spec.schema}.{spec.version_table}:")
            command.current(config)
        return
    if not placement.table_exists and not placement.own:
        config.print_stdout(f"{spec.qualified_name} does not exist yet: run `outbox db upgrade`")
        return
    if placement.table_exists and not placement.own:
        config.print_stdout(
            f"{spec.qualified_name} exists but no Alembic version table records its revision"
        )
        return
    command.current(config)


def _refuse_unless_ours(database_url: str, spec: OutboxTableSpec | None) -> None:
    reason = locate(database_url, spec).refusal()
    if reason:
        raise OutboxError(reason)


def _outbox_revisions(database_url: str, spec: OutboxTableSpec) -> set[str]:
    script = ScriptDirectory.from_config(alembic_config(database_url, spec))
    return {script_.revision for script_ in script.walk_revisions()}


def _read_versions(conn: sa.Connection, schema: str, name: str) -> tuple[str, ...]:
    table = sa.table(name, sa.column("version_num"), schema=schema)
    return tuple(conn.execute(sa.select(table.c.version_num)).scalars())
