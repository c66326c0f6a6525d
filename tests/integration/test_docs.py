"""The code blocks of README.md and docs/*.md run against the real stack, so the docs cannot drift
from the code.

Each fenced block of a file is a test, run in the file's order:

- ``python``: executed in one namespace per file (a block sees what earlier blocks of its file
  defined), against a database of the file's own with the outbox table and the session's Kafka.
  The placeholders the docs use are replaced first: the URLs in :data:`PLACEHOLDERS` by the
  test database's, ``kafka:9092`` and ``broker:9092`` by the broker's. A block with a top-level
  ``await`` runs in an event loop.
- ``sql``: executed in the file's database and committed; a block that creates roles (which
  belong to the whole server, not to the test's database) is rolled back instead.
- ``bash``: every ``outbox`` command is parsed by the real command line (its sub-commands,
  options, choices and types) without running, with the block's ``export``\\ s as the
  environment; every ``make`` target must exist in the Makefile. Any other command makes the
  block need a skip marker.

Other blocks (``ini``, ``json``, plain text) are not collected; docs/migrations.md's ``ini``
snippets are checked verbatim by tests/integration/test_migration_recipe.py.

A comment on the line(s) before a block changes how it runs:

- ``<!-- docs-test: skip (why) -->``: not run; the reason is required and shows as the skip
  reason.
- ``<!-- docs-test: setup NAME ... -->``: the named preludes in :data:`SETUPS` run first (and
  their clean-up after), for blocks that are excerpts of a user's module (an ``order`` the user
  has, an open transaction, a consumer's ``handle``).
"""

from __future__ import annotations

import ast
import asyncio
import gc
import inspect
import json
import os
import re
import shlex
import sys
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import pytest
import sqlalchemy as sa

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "sql", "bash")
#: Topics the docs' examples publish to and send to (created for the test, deleted after).
DOC_TOPICS = ("orders", "payments")
#: Placeholder URLs of the docs, replaced by the file's test database.
PLACEHOLDERS = (
    "postgresql+psycopg://app:pw@db/shop",
    "postgresql+psycopg://billing:pw@db/billing",
    "postgresql+psycopg://orders:pw@db/orders",
)

#: Drivers a service may publish with beside psycopg 3 (docs/publishing.md), in placeholders.
OTHER_DRIVERS = ("psycopg2", "asyncpg")

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
SKIP = re.compile(r"skip\s*\((?P<reason>.*)\)$")
SETUP = re.compile(r"setup\s+(?P<names>[\w\s-]+)$")


# Preludes for blocks that are excerpts: (code run before the block, code run after it). They
# run in the file's namespace, where `URL` and `BOOTSTRAP` name the test's servers.
SETUPS: dict[str, tuple[str, str]] = {
    # The service's engine.
    "engine": ("import sqlalchemy as sa\nengine = sa.create_engine(URL)\n", ""),
    # The file's outbox table in the partitioned layout for the block (after `engine`), and
    # plain again after it.
    "partitioned": (
        "from outbox.partition_layout import convert as _convert\n"
        "from outbox.schema import DEFAULT_SPEC as _SPEC\n"
        "with engine.begin() as _conn:\n    _convert(_conn, _SPEC, partitioned=True)\n",
        "with engine.begin() as _conn:\n    _convert(_conn, _SPEC, partitioned=False)\n",
    ),
    # The service's own ORM model: an `orders` table (without a unique id, so the examples'
    # `id=7` may be written more than once) and the names the examples use with it.
    "models": (
        """
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

if "Order" not in globals():
    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __tablename__ = "orders"
        id: Mapped[int] = mapped_column(sa.BigInteger, primary_key=True)
        total: Mapped[int | None]

    orders = Order.__table__
    engine = sa.create_engine(URL)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE IF NOT EXISTS orders (id bigint, total bigint)"))
""",
        "",
    ),
    # An order the service is about to save.
    "order": ("order = Order(id=NEXT_ID(), total=30)\n", ""),
    # A payment the service captured.
    "payment": ("from types import SimpleNamespace\npayment = SimpleNamespace(id=NEXT_ID())\n", ""),
    # An open outbox transaction `tx`, committed after the block.
    "tx": (
        "from outbox import Outbox\n_tx = Outbox(engine).transaction()\ntx = _tx.__enter__()\n",
        "_tx.__exit__(None, None, None)\n",
    ),
    # An AsyncSession `async_session` for a block with a top-level await.
    "async": (
        """
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

async_engine = create_async_engine(URL)
async_session = AsyncSession(async_engine)


async def AFTER_ASYNC():
    await async_session.close()
    await async_engine.dispose()
""",
        "",
    ),
    # docs/consuming.md's loop: records to consume (one of them twice) and the consumer's
    # `handle`, which ends the loop at the last record. Afterwards the duplicate must have been
    # handled once.
    "consumer": (
        """
import json as _json
import uuid as _uuid

from confluent_kafka import Producer as _Producer

_first, _last = str(_uuid.uuid4()), str(_uuid.uuid4())
_producer = _Producer({"bootstrap.servers": BOOTSTRAP})
for _id, _value in ((_first, {"n": 1}), (_first, {"n": 1}), (_last, {"stop": True})):
    _producer.produce("orders", _json.dumps(_value).encode(), b"7", headers=[("outbox-id", _id)])
assert _producer.flush(30) == 0
handled = []


class StopExample(Exception):
    pass


def handle(session, record):
    handled.append(str(message_id(record)))
    if _json.loads(record.value()) == {"stop": True}:
        raise StopExample  # rolls this record's transaction back and ends the example


EXPECTED_STOP = StopExample
""",
        """
consumer.close()
assert handled.count(_first) == 1 and handled[-1] == _last, handled
with engine.connect() as _conn:
    _done = {str(i) for i in _conn.execute(sa.text("SELECT message_id FROM processed_messages"))
             .scalars()}
assert _first in _done and _last not in _done
""",
    ),
    # An immediate sender the block leaves open.
    "close-sender": ("", "sender.close()\n"),
    # A service's migrations/env.py while Alembic runs it, `target_metadata` its models'.
    "alembic-env": (
        """
import sqlalchemy as sa
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.script import ScriptDirectory

from outbox.migration_support import migrations_dir

_config = Config()
_config.set_main_option("script_location", str(migrations_dir()))
_env = EnvironmentContext(_config, ScriptDirectory.from_config(_config))
_env.__enter__()
target_metadata = sa.MetaData()
""",
        """
_env.__exit__(None, None, None)
assert "public.outbox" in target_metadata.tables, target_metadata.tables
""",
    ),
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str
    skip: str | None = None
    setups: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markers_and_blocks(path: Path) -> Iterator[tuple[int, str | None, Block | None]]:
    """Each marker comment (line, body, None) and each fenced block (line, its marker, block)."""
    lines = path.read_text().splitlines()
    pending: str | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        marker = MARKER.match(line)
        fence = FENCE.match(line)
        if marker:
            if pending is not None:
                raise AssertionError(f"{path.name}:{index + 1}: two markers for one block")
            pending = marker["body"]
            yield index + 1, pending, None
        elif fence and fence["lang"]:
            indent, start = len(fence["indent"]), index + 1
            index += 1
            body = []
            while not lines[index].strip().startswith("```"):
                body.append(lines[index][indent:])
                index += 1
            code = "\n".join(body) + "\n"
            skip = setups = None
            if pending is not None:
                skipped, setup = SKIP.match(pending), SETUP.match(pending)
                skip = skipped["reason"].strip() if skipped else None
                setups = tuple(setup["names"].split()) if setup else None
            yield start, pending, Block(path, start, fence["lang"], code, skip, setups or ())
            pending = None
        elif fence:  # a plain block: not code to paste
            index += 1
            while not lines[index].strip().startswith("```"):
                index += 1
            pending = None
        elif line.strip() and pending is not None:
            raise AssertionError(f"{path.name}:{index + 1}: a docs-test marker not before a block")
        index += 1


def doc_blocks() -> list[Block]:
    return [
        block
        for path in DOC_FILES
        for _line, _marker, block in markers_and_blocks(path)
        if block is not None and block.lang in LANGUAGES
    ]


BLOCKS = doc_blocks()


def test_every_marker_is_known_and_every_skip_says_why() -> None:
    problems = []
    for path in DOC_FILES:
        for line, body, block in markers_and_blocks(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if block is not None or body is None:
                continue
            skipped, setup = SKIP.match(body), SETUP.match(body)
            if body.startswith("skip") and not (skipped and skipped["reason"].strip()):
                problems.append(f"{where}: a skip needs a reason: skip (why)")
            elif setup:
                unknown = set(setup["names"].split()) - set(SETUPS)
                if unknown:
                    problems.append(f"{where}: no setup named {sorted(unknown)} in test_docs.py")
            elif not skipped:
                problems.append(f"{where}: unknown docs-test marker {body!r}")
    assert not problems, "\n".join(problems)
    assert len([b for b in BLOCKS if b.skip is None]) > 2 * len([b for b in BLOCKS if b.skip])


# -- running the blocks ---------------------------------------------------------------------


@dataclass(repr=False)
class DocRun:
    """One file's namespace and database; its blocks run in order."""

    url: str
    bootstrap: str
    namespace: dict[str, Any] = field(init=False)
    engines: list[sa.Engine] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    failed: str | None = None

    def __post_init__(self) -> None:
        # A module of its own, so that what resolves names through sys.modules (SQLAlchemy's
        # annotations) finds the example's.
        self.module = types.ModuleType(f"docs_example_{uuid.uuid4().hex[:8]}")
        sys.modules[self.module.__name__] = self.module
        self.namespace = self.module.__dict__
        counter = iter(range(1000, 10**9))
        self.namespace.update(URL=self.url, BOOTSTRAP=self.bootstrap, NEXT_ID=lambda: next(counter))

    def close(self) -> None:
        """Drop the example's objects (Kafka clients among them) before the servers stop."""
        sys.modules.pop(self.module.__name__, None)
        self.keep_engines()
        for engine in self.engines:
            engine.dispose()
        self.namespace.clear()
        gc.collect()

    def keep_engines(self) -> None:
        """Hold on to the engines the examples made (an `Outbox(url)` makes its own), so they
        are disposed at the end, not collected with open connections when a name is reused."""
        for value in list(self.namespace.values()):
            for candidate in (value, *getattr(value, "__dict__", {}).values()):
                if isinstance(candidate, sa.Engine) and candidate not in self.engines:
                    self.engines.append(candidate)

    def environment(self) -> dict[str, str]:
        """What a user has set up before the docs' commands: the servers to use."""
        return {"OUTBOX_DATABASE_URL": self.url, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": self.bootstrap}

    def substitute(self, code: str) -> str:
        for placeholder in PLACEHOLDERS:
            code = code.replace(placeholder, self.url)
            for driver in OTHER_DRIVERS:  # the same database, through a service's own driver
                theirs = sa.make_url(self.url).set(drivername=f"postgresql+{driver}")
                code = code.replace(
                    placeholder.replace("+psycopg:", f"+{driver}:"),
                    theirs.render_as_string(hide_password=False),
                )
        for broker in ('"kafka:9092"', '"broker:9092"'):
            code = code.replace(broker, repr(self.bootstrap).replace("'", '"'))
        return code

    def run(self, block: Block) -> None:
        if block.lang == "python":
            self.run_python(block)
        elif block.lang == "sql":
            self.run_sql(block)
        else:
            check_bash(block, self.environment())

    def execute(self, code: str, filename: str) -> None:
        compiled = compile(code, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        expected = self.namespace.get("EXPECTED_STOP", ())
        try:
            if compiled.co_flags & inspect.CO_COROUTINE:
                asyncio.run(self.run_async(compiled))
            else:
                exec(compiled, self.namespace)
        except expected:
            pass

    async def run_async(self, compiled: Any) -> None:
        try:
            await eval(compiled, self.namespace)
        finally:
            cleanup = self.namespace.pop("AFTER_ASYNC", None)
            if cleanup is not None:
                await cleanup()

    def run_python(self, block: Block) -> None:
        for name in block.setups:
            self.execute(SETUPS[name][0], f"<setup {name}>")
        try:
            self.execute(self.substitute(block.code), block.name)
        finally:
            self.namespace.pop("EXPECTED_STOP", None)
        for name in reversed(block.setups):
            self.execute(SETUPS[name][1], f"<after {name}>")
        self.keep_engines()

    def run_sql(self, block: Block) -> None:
        engine = sa.create_engine(self.url)
        try:
            with engine.connect() as conn:
                transaction = conn.begin()
                conn.exec_driver_sql(self.substitute(block.code))
                if re.search(r"\bCREATE\s+ROLE\b", block.code, re.IGNORECASE):
                    transaction.rollback()  # roles outlive the test's database
                else:
                    transaction.commit()
        finally:
            engine.dispose()


def commands(code: str) -> Iterator[list[str]]:
    """The shell commands of a block, as words (continuation lines joined, comments dropped)."""
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            yield words


def check_bash(block: Block, environment: dict[str, str]) -> None:
    from outbox.cli import main

    makefile = (ROOT / "Makefile").read_text()
    env = dict(environment)
    for words in commands(block.code):
        program = words[0]
        if program == "export":
            name, _, value = words[1].partition("=")
            env[name] = value
        elif program == "make":
            for target in (w for w in words[1:] if "=" not in w):
                assert re.search(rf"^{re.escape(target)}:", makefile, re.M), (
                    f"{block.name}: no make target {target!r}"
                )
        elif program in ("outbox", ".venv/bin/outbox"):
            parse_command(main, words[1:], env, block)
        else:
            raise AssertionError(
                f"{block.name}: {program!r} is not checked here; mark the block "
                "<!-- docs-test: skip (why) --> if it cannot run"
            )


def parse_command(group: click.Group, args: list[str], env: dict[str, str], block: Block) -> None:
    """Parse ``outbox ARGS`` down to its last sub-command, as the CLI would, without running."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        ctx = group.make_context("outbox", list(args))
        command: click.Command = group
        while isinstance(command, click.Group):
            rest = [*ctx._protected_args, *ctx.args]
            if not rest:
                break
            name, sub, sub_args = command.resolve_command(ctx, rest)
            assert sub is not None and name is not None
            ctx = sub.make_context(name, sub_args, parent=ctx)
            command = sub
    except click.ClickException as exc:
        problem = f"{block.name}: `outbox {shlex.join(args)}`: {exc.format_message()}"
        raise AssertionError(problem) from None
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def doc_runs(postgres_server, outbox_template, kafka_broker) -> Iterator[dict[Path, DocRun]]:  # type: ignore[no-untyped-def]
    """One DocRun per file, each with a database of its own; the docs' topics exist."""
    from confluent_kafka.admin import AdminClient

    import outbox
    from outbox.devstack.topics import create_topics

    bootstrap = kafka_broker.bootstrap_servers
    admin = AdminClient({"bootstrap.servers": bootstrap})
    existing = set(admin.list_topics(timeout=30).topics)
    created = [t for t in DOC_TOPICS if t not in existing]
    create_topics(bootstrap, created)
    default = outbox._default
    names: list[str] = []

    class Runs(dict[Path, DocRun]):
        def __missing__(self, path: Path) -> DocRun:
            name = f"docs_{uuid.uuid4().hex[:12]}"
            names.append(name)
            url = postgres_server.create_database(name, template=outbox_template)
            self[path] = DocRun(url, bootstrap)
            return self[path]

    runs = Runs()
    yield runs
    for run in runs.values():
        run.close()
    outbox._default = default  # docs/immediate-send.md configures the module-level outbox
    for name in names:
        postgres_server.drop_database(name)
    if created:
        for future in admin.delete_topics(created, operation_timeout=30).values():
            future.result(timeout=30)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"{b.name}-{b.lang}")
def test_doc_block(block: Block, doc_runs: dict[Path, DocRun]) -> None:
    if block.skip is not None:
        pytest.skip(f"{block.name}: {block.skip}")
    run = doc_runs[block.path]
    earlier = [b for b in BLOCKS if b.path == block.path and b.line < block.line and not b.skip]
    for before in [*earlier, block]:  # run alone (-k), a block runs its file's earlier ones first
        if before.line in run.done:
            continue
        if run.failed is not None:
            pytest.fail(f"not run: {run.failed} failed, and this block may build on it")
        try:
            run.run(before)
        except BaseException:
            if before.lang != "bash":  # only python and sql blocks build on each other
                run.failed = before.name
            raise
        run.done.add(before.line)


# -- the README's quickstart, as it stands ---------------------------------------------------

README = ROOT / "README.md"


def quickstart_blocks() -> list[Block]:
    """The python blocks of the README's "## Quickstart" section, in order."""
    lines = README.read_text().splitlines()
    start = lines.index("## Quickstart") + 1
    end = next(n for n in range(start, len(lines)) if lines[n].startswith("## ")) + 1
    blocks = [b for b in BLOCKS if b.path == README and start < b.line < end]
    assert blocks and all(b.lang == "python" and not b.skip and not b.setups for b in blocks)
    return blocks


@pytest.fixture
def quickstart_run(outbox_url: str) -> Iterator[DocRun]:
    """A namespace and a database of the quickstart's own, as a new user would start."""
    run = DocRun(outbox_url, "kafka-unused:9092")
    yield run
    run.close()


def test_the_quickstart_publishes_the_ids_the_database_generated(
    quickstart_run: DocRun, engine: sa.Engine
) -> None:
    for block in quickstart_blocks():
        quickstart_run.run(block)
    with engine.connect() as conn:
        orders = set(conn.execute(sa.text("SELECT id FROM orders")).scalars())
        rows = conn.execute(sa.text("SELECT key, value FROM outbox ORDER BY seq")).all()
    assert len(orders) == len(rows) == 2
    for key, value in rows:
        order_id = json.loads(value)["order_id"]
        assert isinstance(order_id, int) and order_id in orders, value
        assert key == str(order_id).encode()


def test_the_quickstart_without_its_flush_fails_loudly_and_writes_nothing(
    quickstart_run: DocRun, engine: sa.Engine
) -> None:
    import outbox

    first = quickstart_blocks()[0]
    flush = "    tx.session.flush()"
    assert flush in first.code
    unflushed = "\n".join(line for line in first.code.splitlines() if not line.startswith(flush))
    with pytest.raises(outbox.InvalidKey, match="flush"):
        quickstart_run.run(Block(first.path, first.line, "python", unflushed + "\n"))
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM orders")).scalar() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar() == 0
