"""faststream-outbox (PyPI) as a peer relay for the bench (crates/bench/src/peers.rs).

    faststream_outbox_peer.py fill  DATABASE_URL ROWS_FILE
    faststream_outbox_peer.py relay DATABASE_URL AMQP_URL QUEUE defaults|tuned

`fill` creates the library's own outbox table (`make_outbox_table`) and writes one row per line of
ROWS_FILE (JSON: the payload as text and the headers, the very rows our relay drains) through the
library's own `publish`, 500 to a transaction. `relay` runs the library's relay as its README
shows it: an outbox subscriber whose return value a RabbitMQ publisher sends (FastStream's
RabbitBroker, publisher confirms on by default) to QUEUE, which the bench has declared as a quorum
queue. It runs until it is stopped; the bench times it by the queue's depth.

`defaults` is the subscriber with none of its tuning parameters given; `tuned` is what they allow
(16 workers, fetches of 512, a 1 ms wait between fetches, deletes flushed 256 at a time).
"""

import asyncio
import json
import signal
import sys

from faststream.rabbit import RabbitBroker, RabbitQueue
from sqlalchemy import MetaData
from sqlalchemy.ext.asyncio import create_async_engine

from faststream_outbox import OutboxBroker, make_outbox_table

OUTBOX_QUEUE = "order-placed"
SETTINGS = {
    "defaults": {},
    "tuned": {
        "max_workers": 16,
        "fetch_batch_size": 512,
        "min_fetch_interval": 0.001,
        "max_fetch_interval": 0.05,
        "terminal_flush_batch_size": 256,
    },
}


def engine_of(database_url, workers=1):
    # The subscriber holds a pooled connection per worker and one to fetch with.
    url = database_url.replace("postgres://", "postgresql+asyncpg://", 1)
    return create_async_engine(url, pool_size=workers + 2)


def table_of(metadata):
    return make_outbox_table(metadata, table_name="outbox")


async def fill(database_url, rows_file):
    engine = engine_of(database_url)
    metadata = MetaData()
    table_of(metadata)
    async with engine.begin() as connection:
        await connection.run_sync(metadata.create_all)
    broker = OutboxBroker(engine, outbox_table=metadata.tables["outbox"])
    with open(rows_file) as lines:
        rows = [json.loads(line) for line in lines]
    for start in range(0, len(rows), 500):
        async with engine.begin() as connection:
            for row in rows[start : start + 500]:
                headers = {key: str(value) for key, value in row["headers"].items()}
                await broker.publish(row["payload"].encode(), queue=OUTBOX_QUEUE, headers=headers, session=connection)
    await engine.dispose()
    print(f"filled {len(rows)}", flush=True)


async def relay(database_url, amqp_url, queue, setting):
    engine = engine_of(database_url, SETTINGS[setting].get("max_workers", 1))
    metadata = MetaData()
    outbox = OutboxBroker(engine, outbox_table=table_of(metadata))
    rabbit = RabbitBroker(amqp_url)
    # The bench declared the quorum queue; the publisher only names it.
    publisher = rabbit.publisher(RabbitQueue(queue, declare=False))

    # The payload passes through as bytes, as ours does: no JSON decoded and encoded again.
    async def raw(message):
        return message.body

    @publisher
    @outbox.subscriber(OUTBOX_QUEUE, decoder=raw, propagate_inbound_headers=True, **SETTINGS[setting])
    async def forward(body: bytes) -> bytes:
        return body

    await rabbit.start()
    await outbox.start()
    print("relaying", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await outbox.stop()
    await rabbit.stop()
    await engine.dispose()


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    asyncio.run({"fill": fill, "relay": relay}[command](*arguments))
