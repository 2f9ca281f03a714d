"""A TCP forwarder from inside the real node's network namespace to the API server on host loopback.

Started by :mod:`megafleet_dev.realnode` as ``python -m megafleet_dev.forward HOLDER_PID TARGET_PORT
LISTEN...``. The node's programs (kubelet, kube-proxy, CoreDNS) and its pods cannot reach host
loopback; this process opens its listening sockets inside the node's netns (a thread may switch
namespaces for the sockets it creates; the sockets stay there) and connects out on host loopback.
Bytes are copied unchanged (TLS ends at the API server), so client certificates work through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys

from megafleet_dev import sandbox


def listen_in_netns(holder_pid: int, addresses: list[tuple[str, int]]) -> list[socket.socket]:
    """Listening sockets created inside the holder's netns; the calling thread returns to its own."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/proc/{holder_pid}/ns/net", os.O_RDONLY)
    try:
        sandbox.libc_call("setns", target, sandbox.CLONE_NEWNET)
        try:
            return [socket.create_server(address, reuse_port=False) for address in addresses]
        finally:
            sandbox.libc_call("setns", own, sandbox.CLONE_NEWNET)
    finally:
        os.close(own)
        os.close(target)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(ConnectionError, OSError):
        writer.close()


async def serve(sockets: list[socket.socket], target_port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    servers = [await asyncio.start_server(handle, sock=sock) for sock in sockets]
    await asyncio.gather(*(server.serve_forever() for server in servers))


def main(argv: list[str]) -> int:
    holder_pid, target_port = int(argv[0]), int(argv[1])
    addresses = [(item.rsplit(":", 1)[0], int(item.rsplit(":", 1)[1])) for item in argv[2:]]
    sockets = listen_in_netns(holder_pid, addresses)
    asyncio.run(serve(sockets, target_port))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
