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
    """The object ``"package.module:attribute"`` names (``attribute`` may be dotted). A
    malformed target, a module that is not there or does not import, or an attribute the
    module does not have raises :class:`~outbox.errors.ConfigError` naming what is missing
    (``example`` shows the form in the message)."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"{target!r} is not module:attribute (e.g. {example})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing and (module_name == missing or module_name.startswith(f"{missing}.")):
            raise ConfigError(
                f"cannot import {module_name}: there is no module {missing} (run from the "
                "directory that holds it, or add that directory to PYTHONPATH)"
            ) from None
        # The module is there; what it imports is not (or fails).
        raise ConfigError(f"cannot import {module_name}: its own import failed: {exc}") from exc
    found: Any = module
    parts = attribute.split(".")
    for depth, part in enumerate(parts):
        if not hasattr(found, part):
            where = f"{module_name}:{'.'.join(parts[:depth])}" if depth else "module " + module_name
            raise ConfigError(f"{where} has no attribute {part!r} (from {target})")
        found = getattr(found, part)
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
