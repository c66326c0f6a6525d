"""`import outbox` loads nothing slow, so that the `outbox` command takes a stop signal from
its first moments (see outbox.early_stop); every public name still loads on first use."""

from __future__ import annotations

import subprocess
import sys


def run(script: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout


def test_import_outbox_loads_no_sqlalchemy_and_every_public_name_loads_on_use() -> None:
    out = run(
        "import sys\n"
        "import outbox\n"
        "print(sorted(m for m in sys.modules if m.startswith(('sqlalchemy', 'psycopg'))))\n"
        "from outbox import Outbox, Message, ID_HEADER, JsonSerializer\n"
        "assert all(getattr(outbox, name) is not None for name in outbox.__all__)\n"
        "print(Outbox.__module__, Message.__module__, ID_HEADER, JsonSerializer.__module__)\n"
    )
    lines = out.splitlines()
    assert lines[0] == "[]"
    assert lines[1] == "outbox.publisher outbox.message outbox-id outbox.serialization"


def test_the_start_up_handler_stays_for_daemons_and_goes_for_other_commands() -> None:
    script = (
        "import signal, sys\n"
        "sys.argv = ['/usr/bin/outbox']\n"
        "from outbox import early_stop\n"
        "from outbox.cli import main\n"
        "def handler():\n"
        "    return signal.getsignal(signal.SIGTERM) is early_stop._stop_before_start\n"
        "print('@', handler())\n"
        "for args in (['relay', '--help'], ['dead', '--help']):\n"
        "    try:\n"
        "        main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    print('@', args[0], handler(), signal.getsignal(signal.SIGINT) is"
        " signal.default_int_handler)\n"
    )
    seen = [line for line in run(script).splitlines() if line.startswith("@ ")]
    assert seen == ["@ True", "@ relay True False", "@ dead False True"]


def test_a_program_importing_the_cli_keeps_its_own_handlers() -> None:
    out = run(
        "import signal\n"
        "from outbox.cli import main\n"
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n"
    )
    assert out.splitlines()[-1] == "True"
