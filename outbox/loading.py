"""Finding the object a command line names as ``package.module:attribute``."""

from __future__ import annotations

import importlib
from typing import Any

from outbox.errors import ConfigError


def load_target(target: str, example: str) -> Any:
    """The object ``"package.module:attribute"`` names (``attribute`` may be dotted), or None
    when the module has no such attribute; a malformed target or a module that does not import
    raises :class:`~outbox.errors.ConfigError` (``example`` shows the form in the message)."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"{target!r} is not module:attribute (e.g. {example})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name}: {exc}") from exc
    found: Any = module
    for part in attribute.split("."):
        found = getattr(found, part, None)
    return found
