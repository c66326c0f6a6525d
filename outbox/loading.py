"""The application's objects the daemons run: found by the ``package.module:attribute`` a
command line names, and registered by name (an inbox's handlers per topic, check-back's
checkers per check group)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any, TypeVar

from outbox.errors import ConfigError

T = TypeVar("T")


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


def register_once(
    table: MutableMapping[str, T],
    fn: T,
    names: Sequence[str],
    *,
    validate: Callable[[str], object],
    what: str,
    name_kind: str,
) -> None:
    """Put ``fn`` (a ``what``: handler, checker) in ``table`` under each of ``names`` (of kind
    ``name_kind``: topic, check group), all of them or, on a
    :class:`~outbox.errors.ConfigError`, none: ``fn`` must be callable, and each name valid and
    not yet taken."""
    if not callable(fn):
        raise ConfigError(f"{what} must be callable, got {type(fn).__name__}")
    if not names:
        raise ConfigError(f"name at least one {name_kind} for the {what}")
    for name in names:
        validate(name)
        if name in table:
            raise ConfigError(f"{name_kind} {name!r} already has a {what}")
    for name in names:
        table[name] = fn
