"""A value that does not serialize, published under an ASGI server (uvicorn, FastAPI): the
server logs one traceback, naming every field that fails, with no private class of the
library in it (the refusal was raised from orjson's error, itself raised from the
serializer's private one: three chained tracebacks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from outbox.devstack.procs import free_port
from tests.relay_helpers import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_a_bad_payload_under_an_asgi_server_logs_one_traceback(
    outbox_url: str, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "uvicorn.log"
    env = {**os.environ, "OUTBOX_DATABASE_URL": outbox_url}
    command = [sys.executable, "-m", "uvicorn", "tests.bad_payload_app:app", "--port", str(port)]
    with log.open("wb") as output:
        server = subprocess.Popen(
            [*command, "--host", "127.0.0.1"],
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert server.poll() is None, f"uvicorn exited: {log.read_text()}"
            try:
                return httpx.get(f"{base}/openapi.json", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 60, "the service to answer")
        assert httpx.post(f"{base}/orders", timeout=30).status_code == 500
        wait_for(lambda: "LossyConversion" in log.read_text(), 10, "the error in the log")
    finally:
        server.terminate()
        server.wait(30)
    text = log.read_text()
    print(text)  # shown with -s: what the service's operator reads
    assert text.count("Traceback (most recent call last)") == 1, text
    assert "The above exception was the direct cause" not in text
    assert "_WouldLose" not in text
    refusal = next(line for line in text.splitlines() if "LossyConversion: " in line)
    assert "value['tags']" in refusal and "value['ratio'] = nan" in refusal, refusal
