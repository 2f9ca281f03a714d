"""An API-server process: the OpenAI frontend of an engine whose model lives in the core process.

Started by :class:`megafleet_engine.core_ipc.core.CoreServer` as ``python -m
megafleet_engine.api_server CONFIG`` (a JSON :class:`~megafleet_engine.core_ipc.core.ApiServerConfig`),
never by hand. It serves the frontend's routes (:func:`megafleet_engine.openai.app.build_frontend_app`)
on the listening socket it inherited (bounded as :mod:`megafleet_engine.http_server` says, with the
frontend's limits, which bound each API-server process on its own), tokenises and detokenises with
the tokenizer the core pickled, and reaches the engine through
:class:`~megafleet_engine.core_ipc.client.CoreClient`. It imports neither torch nor any backend,
and loads no model (``tests/engine/test_engine_api_servers.py`` checks ``sys.modules``). When the
core's pipe reads end-of-file (the core died), it exits at once: its requests could never be
answered. SIGTERM (the core stopping) finishes the responses in flight, then exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvicorn

from megafleet_engine import http_server
from megafleet_engine.backends import base
from megafleet_engine.core_ipc import client as client_module
from megafleet_engine.openai import app as app_module
from megafleet_engine.openai import protocol, serving
from megafleet_protocol import http_limits

__all__ = ["main"]

log = logging.getLogger("megafleet_engine.api_server")


class OneLineFormatter(logging.Formatter):
    """Writes every record's message as one line (:func:`~megafleet_engine.openai.protocol.printable`):
    whatever a request put in a message cannot forge a log line. Tracebacks stay as they are."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = protocol.printable(record.message, limit=None)
        return super().formatMessage(record)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    config: dict[str, Any] = json.loads(Path(args[0]).read_text())
    # Unpickling the tokenizer imports transformers, which imports torch (and CUDA's libraries)
    # when it finds it; marked missing, transformers runs tokenizer-only and any other import fails.
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    tokenizer: base.Tokenizer = pickle.loads(Path(config["tokenizer_file"]).read_bytes())
    asyncio.run(_serve(config, tokenizer))
    return 0


async def _serve(config: dict[str, Any], tokenizer: base.Tokenizer) -> None:
    slot = config["slot"]
    loop = asyncio.get_running_loop()

    def core_gone() -> None:
        log.error("API server %d: the engine core is gone; exiting (no request could be answered)", slot)
        os._exit(1)

    loop.add_reader(config["core_pipe_fd"], core_gone)  # readable only at end-of-file: nobody writes
    client = client_module.CoreClient(
        epoch=config["epoch"],
        core_address=config["core_address"],
        own_address=config["own_address"],
        info=base.ModelInfo(**config["info"]),
        state=config["state"],
        weight_version=config["weight_version"],
        accepting=config["accepting"],
    )
    context = serving.ServingContext(client, tokenizer, client.metrics)
    app = app_module.build_frontend_app(context, api_key=config["api_key"])
    sock = socket.socket(fileno=config["listen_fd"])
    limits = http_limits.HttpLimits(**config["http"])
    http_server.allow_open_files(limits.max_connections)
    server = uvicorn.Server(http_server.config(app, limits, name="frontend"))
    reader = asyncio.create_task(client.run(), name="megafleet-api-server-outputs")

    def reader_ended(task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            log.error("API server %d: reading the core's outputs failed (%r); exiting", slot, task.exception())
            os._exit(1)

    reader.add_done_callback(reader_ended)
    log.info("API server %d (pid %d) serving", slot, os.getpid())
    try:
        await server.serve(sockets=[sock])
    finally:
        reader.remove_done_callback(reader_ended)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        client.close()


if __name__ == "__main__":
    sys.exit(main())
