"""Loads the named SQL queries in ``sql/queries.sql`` for one outbox table."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

import sqlalchemy as sa

from outbox.schema import OutboxTableSpec

_HEADER = re.compile(r"^-- name: (\w+)\n(?:--.*\n)*", re.MULTILINE)


@cache
def _raw_queries() -> dict[str, str]:
    text = resources.files("outbox").joinpath("sql/queries.sql").read_text()
    parts = _HEADER.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {
        name: body.strip().rstrip(";") for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


class Queries:
    """The named queries, with ``{table}`` filled in (names were validated by the spec).

    A query may use another one as a subquery, by its name in braces (``{other_query}``).
    """

    def __init__(self, spec: OutboxTableSpec) -> None:
        self.spec = spec
        table = f'"{spec.schema}"."{spec.table}"'
        raw = _raw_queries()
        self._compiled = {
            name: sa.text(_expand(body, raw).replace("{table}", table))
            for name, body in raw.items()
        }

    def __getitem__(self, name: str) -> sa.TextClause:
        return self._compiled[name]

    def __contains__(self, name: str) -> bool:
        return name in self._compiled


def _expand(body: str, raw: dict[str, str]) -> str:
    for name, other in raw.items():
        body = body.replace("{" + name + "}", other)
    return body
