"""Resolve the stack's jars from Maven Central with the checked-in POMs."""

from __future__ import annotations

from pathlib import Path

from outbox.devstack.procs import StackError
from outbox.spark_jobs.jars import JarsUnresolved
from outbox.spark_jobs.jars import resolve_jars as copy_dependencies

POM_ROOT = Path(__file__).resolve().parent / "maven"
SETTINGS = POM_ROOT / "settings.xml"


def resolve_jars(component: str, jars_dir: Path) -> list[Path]:
    """Copy the runtime jars of ``maven/<component>/pom.xml`` into ``jars_dir``, from Maven
    Central only (``maven/settings.xml``).

    Idempotent: a stamp holding the POM's hash skips Maven when nothing changed, so later
    starts work offline.
    """
    try:
        return copy_dependencies(jars_dir, POM_ROOT / component / "pom.xml", SETTINGS)
    except JarsUnresolved as exc:
        raise StackError(str(exc)) from None
