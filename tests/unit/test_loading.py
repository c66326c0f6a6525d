"""The MODULE:ATTRIBUTE a daemon's command line names: what is missing is named, the attribute
as well as the module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from outbox.errors import ConfigError
from outbox.inbox.api import load_inbox
from outbox.loading import load_target
from outbox.prepared.checkers import load_registry

EXAMPLE = "myapp.handlers:inbox"


def refusal(target: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_target(target, EXAMPLE)
    return str(caught.value)


def test_a_missing_attribute_is_named() -> None:
    assert refusal("tests.inbox_app:inbx") == (
        "module tests.inbox_app has no attribute 'inbx' (from tests.inbox_app:inbx)"
    )
    assert refusal("tests.inbox_app:Inbox.nothing") == (
        "tests.inbox_app:Inbox has no attribute 'nothing' (from tests.inbox_app:Inbox.nothing)"
    )
    # The daemons' loaders say the same, not "is not an Inbox (got NoneType)".
    with pytest.raises(ConfigError, match="has no attribute 'inbx'"):
        load_inbox("tests.inbox_app:inbx")
    with pytest.raises(ConfigError, match="has no attribute 'registri'"):
        load_registry("tests.prepared_app:registri")


def test_a_missing_module_is_named_the_package_or_the_module_within_it() -> None:
    assert refusal("no_such_package.handlers:inbox").startswith(
        "cannot import no_such_package.handlers: there is no module no_such_package ("
    )
    assert refusal("tests.no_such_module:inbox").startswith(
        "cannot import tests.no_such_module: there is no module tests.no_such_module ("
    )


def test_a_module_whose_own_import_fails_is_not_called_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "service_with_a_missing_dependency.py").write_text(
        "import a_dependency_not_installed\ninbox = None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        message = refusal("service_with_a_missing_dependency:inbox")
    finally:
        sys.modules.pop("service_with_a_missing_dependency", None)
    assert message == (
        "cannot import service_with_a_missing_dependency: its own import failed: No module "
        "named 'a_dependency_not_installed'"
    )
