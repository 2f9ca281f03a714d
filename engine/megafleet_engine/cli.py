"""The ``megafleet-engine`` command: the entry point of every engine pod.

Reads :mod:`megafleet_protocol.engine_settings` from ``MEGAFLEET_*`` variables and starts the pod's rank
processes: one per local GPU (spawned, each with its own rank and device), or one on CPU, which
runs in this process. Each rank process joins the shard's process group when the world has more
than one rank (gloo on CPU, NCCL on GPU), loads the backend (megatron: into its TP/PP place), and
serves: the OpenAI frontend on frontend ranks (``tp_rank == 0 and pp_rank == 0``), the pod's agent
and metrics on local rank 0. A frontend rank is the *engine core*: its frontend runs in
``MEGAFLEET_API_SERVERS`` API-server processes it spawns and supervises
(:mod:`megafleet_engine.core_ipc`), which own HTTP and tokenisation and talk to the core over IPC.
The other local ranks serve an agent of their own on the pod IP at ``agent port + local rank``,
which local rank 0's agent forwards refits to (:mod:`megafleet_engine.siblings`). On a
model-parallel megatron shard the ranks other than the first run
:meth:`~megafleet_engine.backends.megatron.MegatronBackend.serve_followers` on a thread of their own
and step in lockstep with the first. SIGTERM or SIGINT stops the servers gracefully (the first rank
then releases its followers); a rank that fails stops its siblings. Every exit on an error writes
its reason to the container's termination message first (:mod:`megafleet_engine.termination`).
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
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import megafleet_engine
from megafleet_engine import engine as engine_module
from megafleet_engine import metrics as metrics_module
from megafleet_engine import server, termination
from megafleet_engine import siblings as siblings_module
from megafleet_engine.refit_attempts import staging_memory
from megafleet_protocol import engine_settings as settings_module

if TYPE_CHECKING:
    from megafleet_engine.backends import base

__all__ = ["main", "run_rank"]

log = logging.getLogger("megafleet_engine")

PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""How long ranks wait for each other at rendezvous: pods of a shard may start minutes apart."""
FOLLOWER_STOP_SECONDS = 30.0
"""How long a following rank waits, once stopped, for its first rank to release it."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megafleet-engine",
        description="Serve one engine pod of a megafleet generation fleet.",
        epilog="Configured by MEGAFLEET_* environment variables (see megafleet_protocol.engine_settings).",
    )
    parser.add_argument("--version", action="version", version=megafleet_engine.__version__)
    parser.parse_args(argv)
    _configure_logging()
    try:
        settings = settings_module.from_env()
    except settings_module.SettingsError as error:
        log.error("invalid configuration: %s", error)
        termination.record(f"invalid configuration: {error}", settings_module.termination_log())
        return 2
    if settings.local_ranks == 1:
        return run_rank(settings, 0)
    return _launch(settings)


def run_rank(settings: settings_module.Settings, local_rank: int) -> int:
    """Run one rank process until SIGTERM/SIGINT; returns the exit status. A failure (an error
    status or an exception) writes its reason to the termination message first."""
    rank = settings.rank + local_rank
    try:
        status, reason = _run_rank(settings, rank, local_rank)
    except Exception as error:
        termination.record(f"rank {rank}: {type(error).__name__}: {error}", settings.termination_log)
        raise
    if reason is not None:
        termination.record(f"rank {rank}: {reason}", settings.termination_log)
    return status


def _run_rank(settings: settings_module.Settings, rank: int, local_rank: int) -> tuple[int, str | None]:
    """:func:`run_rank`'s work: (exit status, why it failed or None)."""
    try:  # secrets first: a missing Secret should fail in a second, not after loading the model
        api_key = settings.api_key
        if settings.api_key_file is not None:
            api_key = server.read_secret(settings.api_key_file, what="API key")
        if settings.agent_token_file is None:  # every rank serves an agent (local rank 0's is the pod's)
            raise RuntimeError("MEGAFLEET_AGENT_TOKEN_FILE is required: the agent API is always authenticated")
        server.read_secret(settings.agent_token_file, what="agent token")
    except RuntimeError as error:
        log.error("rank %d: %s", rank, error)
        return 1, str(error)
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
    backend = _load_backend(settings, rank, local_rank, device=device, deferred=deferred)
    engine = engine_module.Engine(
        backend,
        max_batch_size=settings.max_batch_size,
        weight_version=None if deferred else 0,
        refit_wait_seconds=settings.refit_wait_seconds,
    )
    headroom = settings.refit_staging_headroom_mib * 2**20
    engine.staging = staging_memory.plan(backend, settings.refit_staging, device=device, headroom_bytes=headroom)
    follower = _start_following(backend, rank)
    try:
        servers = _servers(settings, engine, rank, local_rank, api_key=api_key)
        log.info("rank %d: engine %s, weight version %s", rank, engine.state, engine.weight_version)
        asyncio.run(_serve_until_signal(servers))
    except RuntimeError as error:
        log.error("rank %d: %s", rank, error)
        return 1, str(error)
    finally:
        engine.close()
        released = _release(backend, follower, rank)
        # NCCL groups are left to the process's exit: destroy_process_group() hangs
        # (docs/incidents.md#nccl-destroy-hang).
        if settings.world_size > 1 and released and settings.local_gpus == 0:
            _leave_process_group()
    log.info("rank %d: stopped", rank)
    return 0, None


def _load_backend(
    settings: settings_module.Settings, rank: int, local_rank: int, *, device: str, deferred: bool
) -> base.Backend:
    from megafleet_engine import backends  # torch and transformers load here, after the settings check
    from megafleet_engine.backends import base, megatron

    parallel = base.Parallel(
        tensor_parallel=settings.tensor_parallel,
        pipeline_parallel=settings.pipeline_parallel,
        rank=rank,
        world_size=settings.world_size,
        local_rank=local_rank,
        master_addr=settings.master_addr,
        master_port=settings.master_port if settings.world_size > 1 else 0,  # 0: a free port of its own
    )
    options = megatron.EngineOptions(
        max_batch_size=settings.max_batch_size,
        kv_buffer_gb=float(settings.kv_cache_gib),
        cuda_graphs=settings.cuda_graphs,
        fused_kernels=settings.fused_kernels,
        prefill_graphs=settings.prefill_graphs,
        kv_cache_mode=settings.kv_cache_mode,
        staging=settings.refit_staging,
        staging_headroom_mib=settings.refit_staging_headroom_mib,
    )
    return backends.load_backend(
        settings.backend,
        settings.model_source,
        name=settings.model_name,
        max_sequence_length=settings.max_sequence_length,
        dtype=settings.dtype,
        device=device,
        load_weights=not deferred,
        parallel=parallel,
        options=options,
        prefix_caching=None if settings.prefix_caching == "auto" else settings.prefix_caching == "true",
    )


def _start_following(backend: base.Backend, rank: int) -> threading.Thread | None:
    """On a model-parallel rank other than the first: step in lockstep with it, on a thread."""
    if not backend.follows:
        return None
    thread = threading.Thread(target=backend.serve_followers, name=f"megafleet-follower-{rank}", daemon=True)
    thread.start()
    log.info("rank %d: following the shard's first rank", rank)
    return thread


def _release(backend: base.Backend, follower: threading.Thread | None, rank: int) -> bool:
    """Let the backend go: the first rank releases its followers; a follower waits for that.
    Returns whether the process group may be torn down (not while a follower is still blocked)."""
    if follower is not None:
        follower.join(FOLLOWER_STOP_SECONDS)
        if follower.is_alive():
            log.warning("rank %d: the first rank did not release this rank; exiting anyway", rank)
            return False
        return True
    try:
        backend.close()
    except Exception:  # a follower already gone; the process is stopping anyway
        log.warning("rank %d: releasing the backend failed", rank, exc_info=True)
        return False
    return True


def _servers(
    settings: settings_module.Settings,
    engine: engine_module.Engine,
    rank: int,
    local_rank: int,
    *,
    api_key: str | None,
) -> server.EngineServers:
    """Local rank 0 serves the pod's agent (forwarding refits to the other local ranks) and metrics;
    the other local ranks serve an agent of their own at ``agent port + local rank`` on the pod's
    loopback (:func:`~megafleet_engine.siblings.sibling_host`)."""
    siblings = None
    sibling_host = siblings_module.sibling_host(settings.host)
    if local_rank == 0 and settings.local_ranks > 1 and settings.agent_token_file is not None:
        host = f"[{sibling_host}]" if ":" in sibling_host else sibling_host
        urls = tuple(
            f"http://{host}:{siblings_module.sibling_port(settings.agent_port, k)}"
            for k in range(1, settings.local_ranks)
        )
        siblings = siblings_module.Siblings(urls, settings.agent_token_file)
    return server.EngineServers(
        engine,
        server.tokenizer_of(engine.backend),
        metrics_module.Metrics(engine, max_sequence_length=settings.max_sequence_length),
        host=settings.host,
        frontend_port=_frontend_port(settings, rank),
        agent_port=siblings_module.sibling_port(settings.agent_port, local_rank) if settings.agent_port else 0,
        metrics_port=settings.metrics_port if local_rank == 0 else None,
        agent_token_file=settings.agent_token_file,
        api_key=api_key,
        rank=rank,
        world_size=settings.world_size,
        siblings=siblings,
        agent_host=sibling_host if local_rank > 0 else None,
        api_servers=settings.api_server_count,
        http=settings.http_bounds,
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
                # Its own reason is there already unless it could not write one (killed by a signal).
                termination.record(_exit_reason(process.name, code), settings.termination_log)
                status = code if code > 0 else 1
                forward(signal.SIGTERM, None)
    return status


def _exit_reason(name: str, code: int) -> str:
    """Why rank process ``name`` ended, from its exit ``code`` (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"{name} was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"{name} was killed by signal {-code}"
    return f"{name} exited with status {code}"


def _rank_process(settings: settings_module.Settings, local_rank: int) -> None:
    """Entry point of a spawned rank process."""
    _configure_logging()
    sys.exit(run_rank(settings, local_rank))


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
