"""Which jars the audit takes when none are named: from an installed package, those
`outbox reconcile jars` fetched into the user's cache, else the pinned Maven packages; and
the paths the job hands Spark, whose JVM runs in a folder of its own."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from outbox.spark_jobs import jars, launch


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """As from an installed wheel: no outbox.devstack; the cache under ``tmp_path``."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "outbox.devstack" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setenv("OUTBOX_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_an_installed_package_uses_the_jars_reconcile_jars_fetched(installed: Path) -> None:
    assert launch.default_jars() == ((), jars.SPARK_PACKAGES)  # not fetched yet
    folder = jars.cached_jars_dir()
    assert folder.parent == installed / "spark-jars"
    folder.mkdir(parents=True)
    for name in ("postgresql-42.7.7.jar", "spark-sql-kafka-0-10_2.13-4.0.0.jar"):
        (folder / name).write_bytes(b"")
    assert launch.default_jars() == ((), jars.SPARK_PACKAGES)  # no stamp: not finished
    (folder / ".resolved").write_text(jars._digest(jars.POM))
    assert launch.default_jars() == (tuple(str(p) for p in sorted(folder.glob("*.jar"))), ())


def test_the_cache_follows_xdg_and_outbox_cache_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OUTBOX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/var/cache/me")
    assert jars.cache_dir() == Path("/var/cache/me/outbox-kafka")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert jars.cache_dir() == Path.home() / ".cache" / "outbox-kafka"
    monkeypatch.setenv("OUTBOX_CACHE_DIR", "/srv/outbox")
    assert jars.cache_dir() == Path("/srv/outbox")


def test_spark_is_handed_absolute_local_paths_and_uris_as_they_are() -> None:
    from outbox.spark_jobs.session import spark_path

    assert spark_path("audit/2026-11-21/run") == os.path.join(os.getcwd(), "audit/2026-11-21/run")
    assert spark_path("/srv/audit") == "/srv/audit"
    for uri in ("s3a://audit/outbox", "file:/srv/audit", "hdfs://nn/audit"):
        assert spark_path(uri) == uri
