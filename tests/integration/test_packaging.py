"""The sdist and the wheel, installed as a user would, without the dev extras.

Each artifact goes into a clean virtualenv of its own (its runtime dependencies come from the
package index; pip's cache makes that quick). The checks: the commands start, the public API
imports, the distribution installs one top-level name (`outbox`, plus its dist-info), the
development tooling (`outbox.devstack`, `outbox.chaos`) is not in it, and `import outbox`
loads neither the Kafka client nor the Prometheus client.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from collections.abc import Iterator
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
import outbox.relay.daemon, outbox.spark_jobs.cli, outbox.migrations
tooling = {m: importlib.util.find_spec(m) is not None for m in ("outbox.devstack", "outbox.chaos")}
print(json.dumps({"loaded_by_import": loaded_by_import, "public": public, "sender": sender,
                  "top": top, "tooling": tooling}))
"""


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist, and the wheel built from it (as `python -m build` does by default)."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


@pytest.fixture(scope="module", params=["wheel", "sdist"])
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
