"""An ASGI service (FastAPI, async SQLAlchemy) whose one endpoint publishes a value JSON cannot
hold as it is: a set and a NaN, in two fields. ``uvicorn tests.bad_payload_app:app`` with
OUTBOX_DATABASE_URL on a database that has the outbox table."""

from __future__ import annotations

from fastapi import FastAPI

import outbox

ob = outbox.Outbox()
app = FastAPI(title="bad payload")


@app.post("/orders")
async def place_order() -> dict[str, str]:
    async with ob.atransaction() as tx:
        await tx.publish("orders", {"tags": {"gift"}, "ratio": float("nan")}, key="o-1")
    return {"status": "placed"}
