"""A TCP proxy that adds a first-byte delay to every HTTP request, for the namespaced storage tier
(tests/netns_tier.py): `python tests/delay_proxy.py --listen 127.0.0.1:8000 --to 127.0.0.1:8001
--first-byte-ms 30`.

A request is the first client bytes of a connection, and the first client bytes after the server has
sent anything since the client last did (the request/response turn changed): those are held D ms
before they go on, so each request on a keep-alive connection pays the delay once, while a request
body that follows its headers before any answer is not delayed again. Bytes are copied both ways
through large buffers, with no per-chunk cost beyond the copy. `--conn-rate-mbit R` paces each connection's
answers to R Mbit/s, as an object store limits each connection (S3 scales by connections, not by one
stream): a client that reads several objects at once gets several times R, up to the link's shaping.
Prints `ready PORT` on stdout once listening (the parent waits for it) and exits 0 on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

COPY_BYTES = 1 << 20  # one read takes what the socket holds, up to this: no per-chunk delay to amortise


class _Turn:
    """Whose turn it is on one connection: True when the next client bytes start a new request."""

    def __init__(self) -> None:
        self.client_starts_request = True


async def _client_to_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, turn: _Turn,
                            delay_s: float) -> None:
    while data := await reader.read(COPY_BYTES):
        if turn.client_starts_request:
            turn.client_starts_request = False
            if delay_s > 0:
                await asyncio.sleep(delay_s)  # the emulated first-byte latency itself, not a wait for work
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()  # the client's half-close reaches the server; its answer still flows back


async def _server_to_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, turn: _Turn,
                            rate_bytes_s: float = 0.0) -> None:
    loop = asyncio.get_running_loop()
    chunk = COPY_BYTES if not rate_bytes_s else max(16 << 10, min(COPY_BYTES, int(rate_bytes_s / 100)))
    due = 0.0  # when the bytes sent so far have taken their time at the connection's rate
    while data := await reader.read(chunk):
        turn.client_starts_request = True  # set before the client can see the answer and send its next request
        if rate_bytes_s:
            now = loop.time()
            due = max(due, now) + len(data) / rate_bytes_s
            if due - now > 0.002:
                await asyncio.sleep(due - now)  # the emulated per-connection rate itself, not a wait for work
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def _serve_connection(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter,
                            target: tuple[str, int], delay_s: float, rate_bytes_s: float = 0.0) -> None:
    try:
        server_reader, server_writer = await asyncio.open_connection(*target, limit=COPY_BYTES)
    except OSError:
        await _close(client_writer)
        return
    turn = _Turn()
    pumps = [asyncio.create_task(_client_to_server(client_reader, server_writer, turn, delay_s)),
             asyncio.create_task(_server_to_client(server_reader, client_writer, turn, rate_bytes_s))]
    try:
        # a reset on either side ends the connection as a whole: the other pump has nobody to talk to
        await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # also when the proxy stops: no pump outlives its connection
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await _close(server_writer)
        await _close(client_writer)


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


async def serve(listen: tuple[str, int], target: tuple[str, int], first_byte_ms: float,
                conn_rate_mbit: float = 0.0) -> None:
    """Proxy connections on `listen` to `target` until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    connections: set[asyncio.Task] = set()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connections.add(task)
        try:
            await _serve_connection(reader, writer, target, first_byte_ms / 1000, conn_rate_mbit * 1e6 / 8)
        finally:
            connections.discard(task)

    server = await asyncio.start_server(accept, *listen, limit=COPY_BYTES, reuse_address=True)
    port = server.sockets[0].getsockname()[1]
    print(f"ready {port}", flush=True)
    async with server:
        await stop.wait()
        server.close()
        for task in list(connections):
            task.cancel()
        await asyncio.gather(*connections, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT to listen on (port 0: any free one)")
    parser.add_argument("--to", required=True, help="HOST:PORT of the server behind the proxy")
    parser.add_argument("--first-byte-ms", type=float, default=0.0, help="delay added to every request")
    parser.add_argument("--conn-rate-mbit", type=float, default=0.0, help="each connection's answers paced to this")
    args = parser.parse_args(argv)
    asyncio.run(serve(_address(args.listen), _address(args.to), args.first_byte_ms, args.conn_rate_mbit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
