"""Resolve the stack's jars from Maven Central with the checked-in POMs."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from outbox.devstack.procs import StackError

POM_ROOT = Path(__file__).resolve().parent / "maven"
SETTINGS = POM_ROOT / "settings.xml"


def resolve_jars(component: str, jars_dir: Path) -> list[Path]:
    """Copy the runtime jars of ``maven/<component>/pom.xml`` into ``jars_dir``.

    Idempotent: a stamp holding the POM's hash skips Maven when nothing changed, so later
    starts work offline.
    """
    pom = POM_ROOT / component / "pom.xml"
    digest = hashlib.sha256(pom.read_bytes() + SETTINGS.read_bytes()).hexdigest()
    stamp = jars_dir / ".resolved"
    if stamp.exists() and stamp.read_text() == digest:
        return sorted(jars_dir.glob("*.jar"))
    if shutil.which("mvn") is None:
        raise StackError("Maven ('mvn') is not on PATH: install Debian's maven package")
    if jars_dir.exists():
        shutil.rmtree(jars_dir)
    jars_dir.mkdir(parents=True)
    result = subprocess.run(
        [
            "mvn",
            "-q",
            "-B",
            "-s",
            str(SETTINGS),
            "-f",
            str(pom),
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={jars_dir}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        errors = [line for line in result.stdout.splitlines() if "ERROR" in line][:5]
        raise StackError(f"Maven could not resolve {pom}:\n" + "\n".join(errors or [result.stderr]))
    stamp.write_text(digest)
    return sorted(jars_dir.glob("*.jar"))
