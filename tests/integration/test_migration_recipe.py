"""The recipe of docs/migrations.md, followed step by step in a fresh ``alembic init`` project.

Every snippet and command below is first checked to appear verbatim in the docs, then run
with the real ``alembic`` command line, so the docs and this test cannot drift apart.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory
from click.testing import CliRunner

from outbox.cli import main
from outbox.migration_support import alembic_config

pytestmark = pytest.mark.integration

DOCS = Path(__file__).parents[2] / "docs" / "migrations.md"
ALEMBIC = Path(sys.executable).parent / "alembic"

# docs/migrations.md, "Including the outbox in your own Alembic history"
INI_LINES = (
    "path_separator = space\n"
    "version_locations = %(here)s/migrations/versions outbox.migrations:versions\n"
)
INI_LINES_NEWLINE = (
    "path_separator = newline\n"
    "version_locations =\n"
    "    %(here)s/migrations/versions\n"
    "    outbox.migrations:versions\n"
)
ENV_LINES = (
    "from outbox.migration_support import declare_outbox\n\ndeclare_outbox(target_metadata)\n"
)
FIRST_UPGRADE = "alembic upgrade heads"
FIRST_REVISION = (
    'alembic revision --autogenerate -m "create customers" '
    "--head base --branch-label app --version-path migrations/versions"
)
NEXT_REVISION = 'alembic revision --autogenerate -m "add email" --head app@head'
UPGRADE = "alembic upgrade heads"

# The service's own model: not part of the recipe, any project has one.
MODELS = """\
import sqlalchemy as sa

metadata = sa.MetaData()
customers = sa.Table(
    "customers", metadata, sa.Column("id", sa.Integer, primary_key=True), sa.Column("name", sa.Text)
)
"""


def run(project: Path, command: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a documented ``alembic ...`` command line in ``project`` with the real CLI."""
    import shlex

    argv = shlex.split(command)
    assert argv[0] == "alembic"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    result = subprocess.run(
        [str(ALEMBIC), *argv[1:]],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result


def init_project(tmp_path: Path, ini_lines: str, database_url: str = "driver://unused") -> Path:
    """``alembic init``, then the recipe's edits of alembic.ini and env.py."""
    project = tmp_path / "service"
    project.mkdir()
    run(project, "alembic init migrations")
    ini = project / "alembic.ini"
    text = ini.read_text()
    assert "\npath_separator = os\n" in text  # what a current `alembic init` writes
    text = text.replace("\npath_separator = os\n", "\n" + ini_lines)
    text = text.replace(
        "sqlalchemy.url = driver://user:pass@localhost/dbname",
        "sqlalchemy.url = " + database_url.replace("%", "%%"),
    )
    ini.write_text(text)
    (project / "models.py").write_text(MODELS)
    env_py = project / "migrations" / "env.py"
    text = env_py.read_text()
    assert "\ntarget_metadata = None\n" in text
    text = text.replace(
        "\ntarget_metadata = None\n",
        "\nfrom models import metadata\n\ntarget_metadata = metadata\n" + ENV_LINES,
    )
    env_py.write_text(text)
    return project


def outbox_heads() -> set[str]:
    return set(ScriptDirectory.from_config(alembic_config("postgresql://unused")).get_heads())


def versions(url: str, table: str = "alembic_version") -> set[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return set(conn.execute(sa.text(f"SELECT version_num FROM {table}")).scalars())
    finally:
        engine.dispose()


def columns(url: str, table: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return {c["name"] for c in sa.inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def test_the_docs_show_the_steps_this_test_runs() -> None:
    docs = DOCS.read_text()
    for snippet in (INI_LINES, INI_LINES_NEWLINE, ENV_LINES, FIRST_REVISION, NEXT_REVISION):
        assert snippet in docs, snippet
    assert FIRST_UPGRADE in docs and UPGRADE in docs
    assert "alembic stamp 0002_generation_retry_idx      # the revision it printed" in docs


@pytest.mark.parametrize("ini_lines", [INI_LINES, INI_LINES_NEWLINE], ids=["space", "newline"])
def test_alembic_heads_lists_the_outbox_branch(tmp_path: Path, ini_lines: str) -> None:
    project = init_project(tmp_path, ini_lines)
    heads = run(project, "alembic heads").stdout
    for head in outbox_heads():
        assert f"{head} (outbox) (head)" in heads


def test_the_os_separator_of_alembic_init_cannot_hold_the_package_location(
    tmp_path: Path,
) -> None:
    """Why the docs change ``path_separator``: ``os`` cuts the location at its colon."""
    project = init_project(tmp_path, INI_LINES.replace("= space", "= os"))
    result = run(project, "alembic heads", check=False)
    assert not any(head in result.stdout for head in outbox_heads())


def test_the_joined_history_end_to_end(tmp_path: Path, database_url: str) -> None:
    project = init_project(tmp_path, INI_LINES, database_url)

    # Autogenerate compares against a database at every head; the outbox comes first.
    refused = run(project, FIRST_REVISION, check=False)
    assert refused.returncode != 0
    assert "not up to date" in refused.stderr
    run(project, FIRST_UPGRADE)
    assert versions(database_url) == outbox_heads()

    run(project, FIRST_REVISION)
    (first,) = (project / "migrations" / "versions").glob("*create_customers.py")
    assert "create_table('customers'" in first.read_text().replace('"', "'")
    assert "outbox" not in first.read_text()  # nothing proposed for the outbox's table
    run(project, UPGRADE)
    assert run(project, "alembic check").returncode == 0  # nothing left to propose

    # The next revision of the service stacks on its own branch, in its own folder.
    models = project / "models.py"
    models.write_text(
        models.read_text().replace(
            'sa.Column("name", sa.Text)', 'sa.Column("name", sa.Text), sa.Column("email", sa.Text)'
        )
    )
    run(project, NEXT_REVISION)
    (second,) = (project / "migrations" / "versions").glob("*add_email.py")
    assert "'email'" in second.read_text().replace('"', "'")
    assert "outbox" not in second.read_text()
    run(project, UPGRADE)
    assert "email" in columns(database_url, "customers")

    # A database one outbox revision behind, as after installing a release that brings a
    # new outbox revision: the usual `alembic upgrade heads` applies it.
    run(project, "alembic downgrade outbox@-1")
    assert not outbox_heads() & versions(database_url)
    if "0002_generation_retry_idx" in outbox_heads():
        assert "generation" not in columns(database_url, "outbox")
    run(project, UPGRADE)
    assert outbox_heads() <= versions(database_url)
    assert "generation" in columns(database_url, "outbox")
    run(project, "alembic check")

    # `outbox db` sees that another history manages this table and says so.
    current = CliRunner().invoke(main, ["db", "current", "--database-url", database_url])
    assert current.exit_code == 0, current.output
    for head in outbox_heads():
        assert f"{head} (head)" in current.output
    assert "recorded in public.alembic_version" in current.output
    upgrade = CliRunner().invoke(main, ["db", "upgrade", "--database-url", database_url])
    assert upgrade.exit_code == 2
    assert "managed by another Alembic history" in upgrade.output
    assert "alembic upgrade heads" in upgrade.output
    assert "Traceback" not in upgrade.output
    engine = sa.create_engine(database_url)
    try:
        assert "outbox_alembic_version" not in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_a_database_made_by_outbox_db_moves_to_the_joined_history(
    tmp_path: Path, database_url: str
) -> None:
    """docs/migrations.md, "Moving to your own history"."""
    project = init_project(tmp_path, INI_LINES, database_url)
    assert (
        CliRunner().invoke(main, ["db", "upgrade", "--database-url", database_url]).exit_code == 0
    )
    printed = CliRunner().invoke(main, ["db", "current", "--database-url", database_url]).output
    (head,) = outbox_heads()
    assert printed.strip() == f"{head} (head)"

    run(project, f"alembic stamp {head}")
    both = CliRunner().invoke(main, ["db", "upgrade", "--database-url", database_url])
    assert both.exit_code == 2
    assert "recorded both in public.outbox_alembic_version" in both.output
    engine = sa.create_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE public.outbox_alembic_version"))
    finally:
        engine.dispose()

    run(project, UPGRADE)
    assert versions(database_url) == {head}
    check = run(project, "alembic check", check=False)  # customers has no revision yet
    assert "'customers'" in check.stderr
    assert "outbox" not in check.stdout + check.stderr
    now = CliRunner().invoke(main, ["db", "current", "--database-url", database_url])
    assert "recorded in public.alembic_version" in now.output


def test_another_schema_and_table(tmp_path: Path, database_url: str) -> None:
    """docs/migrations.md, "Other schema or table": the same -x values on every command."""
    project = init_project(tmp_path, INI_LINES, database_url)
    (project / "models.py").write_text("import sqlalchemy as sa\n\nmetadata = sa.MetaData()\n")
    env_py = project / "migrations" / "env.py"
    env_py.write_text(
        env_py.read_text().replace(
            "connection=connection, target_metadata=target_metadata",
            "connection=connection, target_metadata=target_metadata, include_schemas=True",
        )
    )
    x = "-x outbox_schema=messaging -x outbox_table=events_out"
    run(project, f"alembic {x} upgrade heads")
    engine = sa.create_engine(database_url)
    try:
        assert "events_out" in sa.inspect(engine).get_table_names(schema="messaging")
    finally:
        engine.dispose()
    run(project, f"alembic {x} check")
    where = ["--database-url", database_url, "--schema", "messaging", "--table", "events_out"]
    current = CliRunner().invoke(main, ["db", "current", *where])
    assert "recorded in public.alembic_version: messaging.events_out" in current.output
