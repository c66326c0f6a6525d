"""The asyncio API: AsyncSession / AsyncConnection, commit and rollback."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import outbox
from outbox import Message, Outbox

pytestmark = pytest.mark.integration


def values(engine: sa.Engine) -> list[bytes]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT value FROM outbox ORDER BY seq")).scalars())


@pytest.mark.asyncio
async def test_atransaction_commits_and_rolls_back(outbox_url: str, engine: sa.Engine) -> None:
    ob = Outbox(outbox_url)
    async with ob.atransaction() as tx:
        await tx.session.execute(sa.text("CREATE TABLE orders (id int primary key)"))
        await tx.session.execute(sa.text("INSERT INTO orders VALUES (1)"))
        result = await tx.publish("orders", {"id": 1}, key=1)
    with pytest.raises(KeyError):
        async with ob.atransaction() as tx:
            await tx.publish_many([Message("orders", b"lost-1"), Message("orders", b"lost-2")])
            raise KeyError("business failure")
    await ob.async_engine.dispose()
    assert values(engine) == [b'{"id":1}']
    with engine.connect() as conn:
        stored_id = conn.execute(sa.text("SELECT id FROM outbox")).scalar_one()
    assert stored_id == result.message_id


@pytest.mark.asyncio
async def test_apublish_joins_callers_async_session_and_connection(
    outbox_url: str, engine: sa.Engine
) -> None:
    async_engine = create_async_engine(outbox_url)
    try:
        async with AsyncSession(async_engine) as session:
            await outbox.apublish(session, "orders", b"from-session")
            async with session.begin_nested() as savepoint:
                await outbox.apublish(session, "orders", b"rolled-back")
                await savepoint.rollback()
            await session.commit()
        async with async_engine.connect() as conn:
            with pytest.raises(outbox.NotInTransaction):
                await outbox.apublish(conn, "orders", b"no-transaction")
            async with conn.begin():
                await outbox.apublish_many(conn, [Message("orders", b"from-connection")])
    finally:
        await async_engine.dispose()
    assert values(engine) == [b"from-session", b"from-connection"]
