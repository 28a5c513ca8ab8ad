"""Bus client overhead against raw nats-py, on a real nats-server.

    .venv/bin/python bench/bus.py [--n 5000] [--size 1024]

Measures, in one run and on the same server: raw JetStream publish (awaiting each ack),
``Bus.publish`` of a pydantic message (validation-free serialisation + headers + trace
injection), and ``Bus.consume`` (fetch, validate, span, ack) of the same messages,
then a claim-checked 1 MiB body round trip. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from kiln.ops.embedded import NatsServer
from kiln.shared import contracts as c
from kiln.shared.bus import Bus
from kiln.shared.config import NatsSettings


async def main(n: int, size: int) -> None:
    server = NatsServer(tempfile.mkdtemp(prefix="kiln-bench-nats-")).start()
    bus = await Bus.connect(NatsSettings(url=server.url, fetch_batch=64), "bench")
    await bus.ensure_topology()
    rows = []
    try:
        payload = b"x" * size
        t = time.perf_counter()
        for i in range(n):
            await bus.js.publish("kiln.run.events", payload)
        rows.append(("raw js.publish (await ack)", n / (time.perf_counter() - t)))
        await bus.js.purge_stream("KILN_EVENTS")

        msg = c.RunEvent(run_id="bench", kind="started", detail="x" * (size - 80))
        t = time.perf_counter()
        for i in range(n):
            await bus.publish(c.RUN_EVENTS, msg, msg_id=f"m{i}")
        rows.append(("Bus.publish (msg id, trace headers)", n / (time.perf_counter() - t)))

        spec = c.ConsumerSpec("KILN_EVENTS", "bench", c.RUN_EVENTS)
        stop = asyncio.Event()
        count = 0

        async def handler(m, d):
            nonlocal count
            count += 1
            if count >= n:
                stop.set()

        t = time.perf_counter()
        await bus.consume(spec, c.RunEvent, handler, stop=stop, concurrency=64)
        rows.append(("Bus.consume (validate, span, ack)", n / (time.perf_counter() - t)))

        big = c.RunEvent(run_id="bench", kind="started", detail="y" * (1 << 20))
        t = time.perf_counter()
        for i in range(20):
            await bus.publish(c.RUN_EVENTS, big, msg_id=f"big{i}")
        rows.append(("Bus.publish 1 MiB (claim-check)", 20 / (time.perf_counter() - t)))
    finally:
        await bus.close()
        server.stop()
    print(f"| operation ({size} B bodies, n={n}) | msgs/s |\n|---|---|")
    for name, rate in rows:
        print(f"| {name} | {rate:,.0f} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--size", type=int, default=1024)
    a = ap.parse_args()
    asyncio.run(main(a.n, a.size))
