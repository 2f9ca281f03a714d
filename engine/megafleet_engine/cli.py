"""The ``megafleet-engine`` command: the entry point of every engine pod.

Reads :mod:`megafleet_engine.settings` from ``MEGAFLEET_*`` variables and starts the pod's rank
processes: one per local GPU (spawned, each with its own rank and device), or one on CPU, which
runs in this process. Each rank process joins the shard's process group when the world has more
than one rank (gloo on CPU, NCCL on GPU), loads the backend, and serves: the OpenAI frontend on
frontend ranks (``tp_rank == 0 and pp_rank == 0``), the agent and metrics on local rank 0.
SIGTERM or SIGINT stops the servers gracefully; a rank that fails stops its siblings.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import signal
import sys
from collections.abc import Sequence

import megafleet_engine
from megafleet_engine import engine as engine_module
from megafleet_engine import metrics as metrics_module
from megafleet_engine import server
from megafleet_engine import settings as settings_module

__all__ = ["main", "run_rank"]

log = logging.getLogger("megafleet_engine")

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""How long ranks wait for each other at rendezvous: pods of a shard may start minutes apart."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megafleet-engine",
        description="Serve one engine pod of a megafleet generation fleet.",
        epilog="Configured by MEGAFLEET_* environment variables (see megafleet_engine.settings).",
    )
    parser.add_argument("--version", action="version", version=megafleet_engine.__version__)
    parser.parse_args(argv)
    _configure_logging()
    try:
        settings = settings_module.from_env()
    except settings_module.SettingsError as error:
        log.error("invalid configuration: %s", error)
        return 2
    if settings.local_ranks == 1:
        return run_rank(settings, 0)
    return _launch(settings)


def run_rank(settings: settings_module.Settings, local_rank: int) -> int:
    """Run one rank process until SIGTERM/SIGINT; returns the exit status."""
    rank = settings.rank + local_rank
    serves_pod = local_rank == 0  # the agent and metrics are served once per pod
    try:  # secrets first: a missing Secret should fail in a second, not after loading the model
        api_key = settings.api_key
        if settings.api_key_file is not None:
            api_key = server.read_secret(settings.api_key_file, what="API key")
        if serves_pod:
            if settings.agent_token_file is None:
                raise RuntimeError("MEGAFLEET_AGENT_TOKEN_FILE is required: the agent API is always authenticated")
            server.read_secret(settings.agent_token_file, what="agent token")
    except RuntimeError as error:
        log.error("rank %d: %s", rank, error)
        return 1
    if settings.world_size > 1:
        _join_process_group(settings, rank, local_rank)
    device = "cpu" if settings.local_gpus == 0 else f"cuda:{local_rank}"
    deferred = settings.weights_initial == "refit"
    log.info(
        "rank %d of %d: loading %s (%s backend, %s, %s)%s",
        rank,
        settings.world_size,
        settings.model_source,
        settings.backend,
        settings.dtype,
        device,
        ", weights deferred until the first refit" if deferred else "",
    )
    from megafleet_engine import backends  # torch and transformers load here, after the settings check

    backend = backends.load_backend(
        settings.backend,
        settings.model_source,
        name=settings.model_name,
        max_sequence_length=settings.max_sequence_length,
        dtype=settings.dtype,
        device=device,
        load_weights=not deferred,
    )
    engine = engine_module.Engine(
        backend, max_batch_size=settings.max_batch_size, weight_version=None if deferred else 0
    )
    try:
        servers = _servers(settings, engine, rank, api_key=api_key, serves_pod=serves_pod)
        log.info("rank %d: engine %s, weight version %s", rank, engine.state, engine.weight_version)
        asyncio.run(_serve_until_signal(servers))
    except RuntimeError as error:
        log.error("rank %d: %s", rank, error)
        return 1
    finally:
        engine.close()
        if settings.world_size > 1:
            _leave_process_group()
    log.info("rank %d: stopped", rank)
    return 0


def _servers(
    settings: settings_module.Settings,
    engine: engine_module.Engine,
    rank: int,
    *,
    api_key: str | None,
    serves_pod: bool,
) -> server.EngineServers:
    return server.EngineServers(
        engine,
        server.tokenizer_of(engine.backend),
        metrics_module.Metrics(engine),
        host=settings.host,
        frontend_port=_frontend_port(settings, rank),
        agent_port=settings.agent_port if serves_pod else None,
        metrics_port=settings.metrics_port if serves_pod else None,
        agent_token_file=settings.agent_token_file,
        api_key=api_key,
        rank=rank,
        world_size=settings.world_size,
    )


def _frontend_port(settings: settings_module.Settings, rank: int) -> int | None:
    """The frontend port of ``rank``: ``None`` unless a frontend rank; the k-th frontend rank of the
    pod gets ``frontend_port + k`` (only context parallelism puts several in one pod)."""
    if not settings.is_frontend_rank(rank):
        return None
    local = [r for r in range(settings.rank, settings.rank + settings.local_ranks) if settings.is_frontend_rank(r)]
    return settings.frontend_port + local.index(rank) if settings.frontend_port else 0


async def _serve_until_signal(servers: server.EngineServers) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, servers.stop)
    await servers.serve()


def _join_process_group(settings: settings_module.Settings, rank: int, local_rank: int) -> None:
    import torch
    import torch.distributed

    backend = "nccl" if settings.local_gpus > 0 else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    log.info(
        "rank %d: joining the shard's process group (%s, %d ranks) at %s:%d",
        rank,
        backend,
        settings.world_size,
        settings.master_addr,
        settings.master_port,
    )
    torch.distributed.init_process_group(
        backend,
        init_method=f"tcp://{settings.master_addr}:{settings.master_port}",
        rank=rank,
        world_size=settings.world_size,
        timeout=PROCESS_GROUP_TIMEOUT,
    )


def _leave_process_group() -> None:
    import torch.distributed

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _launch(settings: settings_module.Settings) -> int:
    """Spawn one process per local GPU and wait; the first to fail stops the others."""
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_rank_process, args=(settings, local_rank), name=f"rank-{settings.rank + local_rank}")
        for local_rank in range(settings.local_ranks)
    ]
    log.info(
        "starting %d rank processes (ranks %d to %d)", len(processes), settings.rank, settings.rank + len(processes) - 1
    )
    for process in processes:
        process.start()

    def forward(signum: int, frame: object) -> None:
        for process in processes:
            if process.is_alive():
                process.terminate()

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    running = list(processes)
    status = 0
    while running:
        multiprocessing.connection.wait([process.sentinel for process in running])
        for process in [process for process in running if not process.is_alive()]:
            running.remove(process)
            code = process.exitcode or 0
            if code != 0 and status == 0:
                log.error("%s exited with status %d; stopping the other ranks", process.name, code)
                status = code if code > 0 else 1
                forward(signal.SIGTERM, None)
    return status


def _rank_process(settings: settings_module.Settings, local_rank: int) -> None:
    """Entry point of a spawned rank process."""
    _configure_logging()
    sys.exit(run_rank(settings, local_rank))


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
