"""The sdist and the wheel as `make dist` builds them, installed as a user would, without the
dev extras, and the checkout installed as the README says (`pip install .`).

Each goes into a clean virtualenv of its own (its runtime dependencies come from the package
index; pip's cache makes that quick). The checks: the build warns of nothing; the sdist
carries the examples, the docs and the changelog, and the README names the files that
`make dist` makes; the commands start, the public API imports, the distribution installs one
top-level name (`outbox`, plus its dist-info), the development tooling (`outbox.devstack`,
`outbox.chaos`) is not in it, and `import outbox` loads neither the Kafka client nor the
Prometheus client; the changelog has an upgrade note for every schema revision.
"""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
import venv
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Run inside the installed virtualenv; prints one JSON object.
PROBE = """
import json, sys
import outbox
loaded_by_import = sorted(
    m for m in sys.modules if m.split(".")[0] in ("confluent_kafka", "prometheus_client", "pyspark")
)
from outbox import *  # noqa: F403
public = {name: hasattr(outbox, name) for name in outbox.__all__}
sender = outbox.ImmediateSender.__module__
import importlib.metadata as md
import importlib.util
files = md.distribution("outbox-kafka").files or []
top = sorted({f.parts[0] for f in files if f.parts[0] != ".."})
import outbox.relay.daemon, outbox.spark_jobs.cli, outbox.migrations, outbox.wal.reader
tooling = {m: importlib.util.find_spec(m) is not None for m in ("outbox.devstack", "outbox.chaos")}
print(json.dumps({"loaded_by_import": loaded_by_import, "public": public, "sender": sender,
                  "top": top, "tooling": tooling}))
"""


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path
    output: str  # what the build printed


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """`make dist`: the sdist, and the wheel built from it."""
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), "dist", f"DIST_DIR={out}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Built(sdist, wheel, result.stdout + result.stderr)


@pytest.fixture(scope="module")
def artifacts(built: Built) -> dict[str, Path]:
    """What each virtualenv installs: an artifact, or the checkout itself."""
    return {"sdist": built.sdist, "wheel": built.wheel, "checkout": ROOT}


@pytest.fixture(scope="module", params=["wheel", "sdist", "checkout"])
def installed(
    request: pytest.FixtureRequest,
    artifacts: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Path]:
    """A clean virtualenv with one artifact installed; yields its bin folder."""
    env_dir = tmp_path_factory.mktemp(f"venv-{request.param}")
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "-q", str(artifacts[request.param])],
        check=True,
        capture_output=True,
        timeout=900,
    )
    yield bin_dir


def run(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Outside the repository, so that nothing there shadows the installed package.
    return subprocess.run(
        [str(bin_dir / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=bin_dir,
    )


def test_the_commands_start(installed: Path) -> None:
    for args in (["--help"], ["relay", "--help"], ["reconcile", "--help"]):
        result = run(installed, "outbox", *args)
        assert result.returncode == 0, result.stderr
    listed = run(installed, "outbox", "--help").stdout
    assert "relay" in listed and "reconcile" in listed
    assert "dev " not in listed and "chaos" not in listed  # tooling is not in the package
    refused = run(installed, "outbox", "dev", "up")
    assert refused.returncode == 2
    assert "source checkout" in refused.stderr


def test_the_package_is_one_import_name_and_imports_lazily(installed: Path) -> None:
    result = run(installed, "python", "-c", PROBE)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["loaded_by_import"] == []
    assert all(found["public"].values()), found["public"]
    assert found["sender"] == "outbox.immediate"
    assert found["top"] == ["outbox", "outbox_kafka-0.1.0.dist-info"]
    assert found["tooling"] == {"outbox.devstack": False, "outbox.chaos": False}


def test_the_migrations_ship(installed: Path) -> None:
    # Offline mode: Alembic prints the SQL, so no database is needed to see the revisions.
    result = run(
        installed,
        "outbox",
        "db",
        "upgrade",
        "--sql",
        "--database-url",
        "postgresql+psycopg://user@127.0.0.1/db",
    )
    assert result.returncode == 0, result.stderr
    assert "CREATE TABLE public.outbox" in result.stdout


def test_the_dashboard_ships_and_names_the_extra_it_needs(installed: Path, built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as wheel:
        names = set(wheel.namelist())
    assert {
        "outbox/dashboard/templates/overview.html",
        "outbox/dashboard/static/dashboard.css",
    } <= (names)
    assert run(installed, "outbox", "dashboard", "--help").returncode == 0
    # Installed without the extra: one line that says which one.
    url = "postgresql+psycopg://user@127.0.0.1:1/db"
    result = run(installed, "outbox", "dashboard", "--database-url", url)
    assert result.returncode == 2
    assert "pip install 'outbox-kafka[dashboard]'" in result.stderr


def test_the_build_warns_of_nothing(built: Built) -> None:
    # PYTHONDONTWRITEBYTECODE (set on some machines) makes setuptools say it skips
    # byte-compiling: that is the environment's, not the package's.
    warnings = [
        line
        for line in built.output.splitlines()
        if re.search(r"warn", line, re.IGNORECASE) and "byte-compiling is disabled" not in line
    ]
    assert warnings == [], "\n".join(warnings)


def test_the_wheel_ships_the_django_app_and_the_audits_jar_list(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as wheel:
        names = set(wheel.namelist())
    assert "outbox/django/migrations/0001_outbox_table.py" in names
    assert "outbox/spark_jobs/jars.pom.xml" in names


def test_the_sdist_carries_the_examples_the_docs_and_the_changelog(built: Built) -> None:
    with tarfile.open(built.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    examples = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "examples").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    docs = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")}
    assert examples and examples <= names, sorted(examples - names)
    assert docs and docs <= names, sorted(docs - names)
    assert "CHANGELOG.md" in names
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    with zipfile.ZipFile(built.wheel) as wheel:
        assert not [n for n in wheel.namelist() if n.startswith(("examples/", "docs/"))]


def test_the_readme_names_what_make_dist_makes_and_how_to_install_today(built: Built) -> None:
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install into your own service") :]
    install = install[: install.index("\n## ")]
    assert f"dist/{built.sdist.name}" in install and f"dist/{built.wheel.name}" in install
    assert "pip install ." in install and 'pip install "./[spark]"' in install
    assert "not on the public package index yet" in install and "`outbox-kafka`" in install


def test_make_dist_needs_no_development_set_up(tmp_path: Path) -> None:
    """`make dist` on a machine without the project's virtualenv: nothing but `build`."""
    planned = subprocess.run(
        ["make", "--no-print-directory", "-n", "-C", str(ROOT), "dist",
         f"VENV={tmp_path / 'no-venv'}", f"BUILD_VENV={tmp_path / 'build-venv'}"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "-m build" in planned.stdout
    assert "[dev" not in planned.stdout and "no-venv" not in planned.stdout, planned.stdout
    assert "outbox dev" not in planned.stdout


def test_the_spark_extra_pins_pyspark(installed: Path) -> None:
    probe = "import importlib.metadata as md; print('\\n'.join(md.requires('outbox-kafka')))"
    result = run(installed, "python", "-c", probe)
    assert result.returncode == 0, result.stderr
    assert 'pyspark==4.0.0; extra == "spark"' in result.stdout.splitlines()


def revisions(folder: Path) -> list[str]:
    found = [
        re.search(r'^revision = "([^"]+)"$', path.read_text(), re.MULTILINE)
        for path in sorted(folder.glob("*.py"))
        if path.name != "__init__.py"
    ]
    assert found and all(found)
    return [match[1] for match in found if match]


def test_the_changelog_has_an_upgrade_note_for_every_schema_revision() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    notes = changelog[changelog.index("### Upgrade notes") :]
    rows = {line.split("`")[1] for line in notes.splitlines() if line.startswith("| `")}
    every = revisions(ROOT / "migrations" / "versions") + revisions(
        ROOT / "outbox" / "inbox" / "migrations" / "versions"
    )
    assert len(every) >= 7
    assert set(every) <= rows, sorted(set(every) - rows)
