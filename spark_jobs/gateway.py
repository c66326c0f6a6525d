"""Starting Spark's JVM: in a working directory of outbox's own, and, when it must resolve
Maven packages, with Ivy's report held back.

Spark 4.0 makes its artifact folder (``artifacts/spark-<uuid>``) relative to the JVM's
working directory and leaves ``artifacts/`` behind; started from a service's folder, the
audit would write there. So the JVM starts in :func:`jvm_working_dir` (in the user's cache),
and the job hands Spark absolute paths (:func:`outbox.spark_jobs.session.spark_path`).

Spark resolves ``spark.jars.packages`` with Ivy while its JVM starts. When that fails, the JVM
exits after about a hundred lines of Ivy output and PySpark says only ``[JAVA_GATEWAY_EXITED]
Java gateway process exited before sending its port number``. Here the JVM writes to a file
instead: on failure the cause Ivy gave becomes :class:`PackagesUnresolved`; on success the
file is copied on to stderr from there on (Spark's warnings), the resolution report left out.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from outbox.spark_jobs.jars import cache_dir

#: Ivy's summary of a failed resolution: ``[download failed: g#a;v!a.jar]``, ``[unresolved
#: dependency: g#a;v: not found]``, as Spark's SparkSubmit throws it.
_THROWN = re.compile(r'Exception in thread "main" [\w.$]+(?:Exception|Error): (?P<cause>.+)')
#: Where Ivy looked for what it did not find: ``file:/home/u/.m2/.../x.jar``.
_TRIED = re.compile(r"^\s+(?P<url>(?:file|https?):\S+)$")


class PackagesUnresolved(RuntimeError):
    """Spark could not resolve ``spark.jars.packages``; the message is Ivy's cause, one line."""

    def __init__(self, cause: str, tried: tuple[str, ...] = ()) -> None:
        text = cause + (f" (tried {', '.join(tried)})" if tried else "")
        super().__init__(text)
        self.cause = cause
        self.tried = tried


def ivy_cause(output: str) -> PackagesUnresolved | None:
    """The cause of a failed resolution in Spark's output, or None when it shows none."""
    thrown = None
    tried: list[str] = []
    for line in output.splitlines():
        match = _THROWN.match(line.strip())
        if match and thrown is None:
            thrown = match["cause"].strip().removeprefix("[").removesuffix("]")
        found = _TRIED.match(line)
        if found and found["url"] not in tried:
            tried.append(found["url"])
    if thrown is None:
        return None
    return PackagesUnresolved(thrown, tuple(tried[:3]))


def jvm_working_dir() -> Path:
    """Where Spark's JVM runs: ``spark/`` in outbox's cache (see
    :func:`outbox.spark_jobs.jars.cache_dir`), made if need be."""
    folder = cache_dir() / "spark"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def launch_jvm(options: Mapping[str, str]) -> None:
    """Start the JVM for ``options`` in :func:`jvm_working_dir`, unless one runs already.

    Under ``spark-submit`` (``PYSPARK_GATEWAY_PORT``) or with a JVM already started, nothing is
    done (the packages were resolved then). With packages to resolve, raises
    :class:`PackagesUnresolved` on an Ivy failure; any other failure to start is PySpark's
    own error, as without this.
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if "PYSPARK_GATEWAY_PORT" in os.environ or SparkContext._gateway is not None:
        return
    conf = SparkConf(loadDefaults=False).setAll(list(options.items()))
    where = {"cwd": str(jvm_working_dir())}
    if "spark.jars.packages" not in options:
        gateway = launch_gateway(conf, popen_kwargs=where)  # type: ignore[no-untyped-call]
        SparkContext._ensure_initialized(gateway=gateway)
        return
    output = tempfile.TemporaryFile()  # noqa: SIM115 (the JVM writes to it for its whole life)
    try:
        gateway = launch_gateway(  # type: ignore[no-untyped-call]
            conf, popen_kwargs={**where, "stdout": output, "stderr": output}
        )
    except Exception:
        output.seek(0)
        found = ivy_cause(output.read().decode(errors="replace"))
        output.close()
        if found is not None:
            raise found from None
        raise
    SparkContext._ensure_initialized(gateway=gateway)
    _forward(output, sys.stderr)


def _forward(source: IO[bytes], target: IO[str], every: float = 0.2) -> None:
    """Copy what the JVM writes to ``source`` from now on to ``target``, in the background."""
    position = source.tell()

    def copy() -> None:  # for the JVM's whole life, which is the process's
        nonlocal position
        while True:
            time.sleep(every)
            chunk = os.pread(source.fileno(), 65536, position)
            if chunk:
                position += len(chunk)
                target.write(chunk.decode(errors="replace"))
                target.flush()

    threading.Thread(target=copy, name="spark-jvm-output", daemon=True).start()
