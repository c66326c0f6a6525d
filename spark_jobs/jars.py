"""The jars the job needs beside Spark's own (no PySpark import here), and where a service
that installed the package keeps them.

Spark's Kafka source and the PostgreSQL JDBC driver, pinned to the PySpark in pyproject.toml,
as Maven coordinates (:data:`SPARK_PACKAGES`, for ``spark.jars.packages``) and as the POM
beside this file, which ``outbox reconcile jars`` resolves with Maven into the user's cache
(:func:`resolve_jars`), once; the runs after it take them from there. The local stack resolves
the same POM (devstack/maven/spark/pom.xml is a link to it); tests/unit/test_reconcile_parts.py
keeps the coordinates and the POM in step.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SPARK_PACKAGES = (
    "org.apache.spark:spark-sql-kafka-0-10_2.13:4.0.0",
    "org.postgresql:postgresql:42.7.7",
)

#: The POM whose runtime dependencies are the job's jars.
POM = Path(__file__).resolve().with_name("jars.pom.xml")


class JarsUnresolved(RuntimeError):
    """Maven is missing, or could not resolve the POM; the message says which, in a line or
    a few."""


def cache_dir() -> Path:
    """Where outbox keeps what it fetches or needs on this machine: ``OUTBOX_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/outbox-kafka``, else ``~/.cache/outbox-kafka``."""
    explicit = os.environ.get("OUTBOX_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "outbox-kafka"


def cached_jars_dir() -> Path:
    """The folder ``outbox reconcile jars`` resolves the jars into (one per POM version)."""
    return cache_dir() / "spark-jars" / _digest(POM)[:12]


def cached_jars() -> list[Path] | None:
    """The jars ``outbox reconcile jars`` resolved for this POM, or None when it has not."""
    folder = cached_jars_dir()
    stamp = folder / ".resolved"
    if stamp.exists() and stamp.read_text() == _digest(POM):
        return sorted(folder.glob("*.jar"))
    return None


def resolve_jars(
    target: Path | None = None, pom: Path = POM, settings: Path | None = None
) -> list[Path]:
    """Copy the runtime jars of ``pom`` into ``target`` (default :func:`cached_jars_dir`) with
    ``mvn dependency:copy-dependencies``, from the repositories Maven is set up with (or those
    of ``settings``). Idempotent: a stamp holding the POM's hash skips Maven when nothing
    changed, so later runs work offline. Raises :class:`JarsUnresolved`."""
    target = target or cached_jars_dir()
    digest = _digest(pom, settings)
    stamp = target / ".resolved"
    if stamp.exists() and stamp.read_text() == digest:
        return sorted(target.glob("*.jar"))
    if shutil.which("mvn") is None:
        raise JarsUnresolved("Maven ('mvn') is not on PATH: install Debian's maven package")
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    command = ["mvn", "-q", "-B", *(["-s", str(settings)] if settings else []), "-f", str(pom)]
    command += [
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={target}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        errors = [line for line in result.stdout.splitlines() if "ERROR" in line][:5]
        raise JarsUnresolved(
            f"Maven could not resolve {pom}:\n" + "\n".join(errors or [result.stderr.strip()])
        )
    stamp.write_text(digest)
    return sorted(target.glob("*.jar"))


def _digest(pom: Path, settings: Path | None = None) -> str:
    data = pom.read_bytes() + (settings.read_bytes() if settings else b"")
    return hashlib.sha256(data).hexdigest()
