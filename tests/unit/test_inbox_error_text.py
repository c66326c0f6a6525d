"""A handler's error as it is parked: the traceback is cut to keep the whole text within
MAX_ERROR_TEXT, so that the store's own cut never eats the innermost frame; what a list shows
of it, and what names its cause."""

from __future__ import annotations

from typing import Any

from outbox.inbox.apply import MAX_ERROR_TEXT, handler_error
from outbox.traceback_text import error_line, without_library_frames


def deep_error(depth: int) -> BaseException:
    """A KeyError raised ``depth`` distinct frames down (no repeated lines to fold)."""
    source = "def f0():\n    raise KeyError('total')\n" + "".join(
        f"def f{i}():\n    f{i - 1}()\n" for i in range(1, depth)
    )
    names: dict[str, Any] = {}
    exec(compile(source, "handlers_with_a_long_module_path.py", "exec"), names)
    try:
        names[f"f{depth - 1}"]()
    except KeyError as exc:
        return exc
    raise AssertionError("no error")


def test_a_cut_traceback_stays_within_the_bound_and_keeps_the_innermost_frame() -> None:
    for depth in range(150, 200):
        text = handler_error(deep_error(depth))
        assert len(text) <= MAX_ERROR_TEXT, (depth, len(text))
        assert text.startswith("KeyError: 'total'\nTraceback (most recent call last):\n  ...\n")
        assert text.endswith("line 2, in f0")  # the innermost frame, whole


PARKED = (
    "KeyError: 'customer_email'\n"
    "Traceback (most recent call last):\n"
    '  File "/srv/venv/lib/python3.11/site-packages/outbox/inbox/apply.py", line 360, in '
    "apply_requeued\n"
    "    await self._call(tx, [item] if batch else item)\n"
    '  File "/srv/app/billing/handlers.py", line 12, in send_receipt\n'
    '    payload["email"] = payload["customer_email"]\n'
    "                       ~~~~~~~^^^^^^^^^^^^^^^^^^"
)


def test_the_error_line_is_the_exceptions_not_the_tracebacks_last() -> None:
    assert error_line(PARKED) == "KeyError: 'customer_email'"
    assert error_line("value is not JSON: unexpected character at 12") == (
        "value is not JSON: unexpected character at 12"
    )
    assert error_line(None) == ""


def test_the_librarys_frames_are_left_out_wherever_it_is_installed() -> None:
    kept = without_library_frames(PARKED)
    assert "apply_requeued" not in kept and "site-packages/outbox/" not in kept
    assert kept.startswith("KeyError: 'customer_email'\nTraceback (most recent call last):\n")
    assert kept.endswith(
        '  File "/srv/app/billing/handlers.py", line 12, in send_receipt\n'
        '    payload["email"] = payload["customer_email"]\n'
        "                       ~~~~~~~^^^^^^^^^^^^^^^^^^"
    )
    # An application of its own under a directory called outbox keeps its frames.
    own = PARKED.replace("/srv/app/billing/", "/srv/outbox/billing/")
    assert "/srv/outbox/billing/handlers.py" in without_library_frames(own)
    assert without_library_frames("ValueError: no traceback") == "ValueError: no traceback"
