"""Where a refit world meets: its :class:`Rendezvous` (the trainer's store address and the world's
ranks), hosting or joining the trainer's ``TCPStore`` there, and the local address to bind.

Called by :meth:`Communicator.connect <megafleet_protocol.refit.communicator.Communicator.connect>`
(:func:`open_store`, after :func:`wait_listening` on a receiver), by the NeMo collective's rendezvous
(:mod:`~megafleet_protocol.refit.nemo_rendezvous`, :func:`wait_listening`), and by the engine's refit
attempts (:mod:`megafleet_engine.refit_attempts`: :func:`local_address_towards`, through
:mod:`~megafleet_protocol.refit.communicator`).
Every wait here ends at the attempt's deadline or its abort: ``TCPStore``'s own client retries
until its timeout but overruns it and cannot be interrupted
(docs/incidents.md#gloo-abort-tcpstore-timeout), so a client is built only once a plain TCP probe
found the store listening.
"""

from __future__ import annotations

import dataclasses
import socket
import threading

from torch._C import _distributed_c10d as c10d  # Store classes: torch.distributed re-exports them untyped

from megafleet_protocol.refit import deadlines, errors

__all__ = ["Rendezvous", "local_address_towards", "open_store", "wait_listening"]

STORE_PROBE_FIRST_SECONDS = 0.002
STORE_PROBE_MAX_SECONDS = 0.05
"""Backoff between probes for the trainer's store, which the trainer may open after the agents join
(a TCP connect to one address: cheap enough to repeat every 50 ms, and the store is found within
that once it listens)."""


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where and how large the trainer+fleet world of one attempt is.

    Attributes:
        address: host or IP of the trainer's rank 0, where its ``TCPStore`` listens.
        port: the store's port; a fresh one per attempt.
        world_size: trainer ranks plus the ranks of every live shard.
        trainer_world_size: trainer ranks (they come first).
    """

    address: str
    port: int
    world_size: int
    trainer_world_size: int = 1

    def __post_init__(self) -> None:
        if self.trainer_world_size < 1 or self.world_size <= self.trainer_world_size:
            raise ValueError(
                f"a refit world of {self.world_size} ranks with {self.trainer_world_size} trainer ranks has no fleet"
            )

    @property
    def group_size(self) -> int:
        """Ranks of the transfer group: trainer rank 0 and every fleet rank."""
        return self.world_size - self.trainer_world_size + 1

    def group_rank(self, global_rank: int) -> int:
        """The transfer-group rank of global rank ``global_rank`` (trainer rank 0 or a fleet rank)."""
        if global_rank == 0:
            return 0
        if not self.trainer_world_size <= global_rank < self.world_size:
            raise ValueError(
                f"rank {global_rank} is not trainer rank 0 nor a fleet rank "
                f"({self.trainer_world_size}..{self.world_size - 1}) of this refit world"
            )
        return global_rank - self.trainer_world_size + 1

    def global_rank(self, group_rank: int) -> int:
        return 0 if group_rank == 0 else group_rank + self.trainer_world_size - 1


def wait_listening(
    address: str, port: int, *, deadline: deadlines.Deadline, aborted: threading.Event, what: str
) -> None:
    """Wait until ``address:port`` accepts connections, or the deadline or an abort (``what``, the
    awaited event, names it in errors).

    A plain TCP probe, retried with backoff: ``TCPStore``'s own client retries until its timeout but
    overruns it and cannot be interrupted (docs/incidents.md#gloo-abort-tcpstore-timeout), so
    probing first keeps a receiver whose trainer never comes exactly to its deadline and abortable.
    """
    delay = STORE_PROBE_FIRST_SECONDS
    while True:
        remaining = deadline.left(what).total_seconds()
        try:
            with socket.create_connection((address, port), timeout=min(remaining, 5.0)):
                return
        except OSError:
            pass
        if aborted.wait(min(delay, max(deadline.remaining, 0.0))):
            raise errors.RefitAborted(f"the refit was aborted before {what}")
        delay = min(delay * 2, STORE_PROBE_MAX_SECONDS)


def open_store(rendezvous: Rendezvous, *, is_master: bool, deadline: deadlines.Deadline) -> c10d.Store:
    """The trainer's store server (listening on its address only) or a client of it."""
    what = "connecting to the trainer's rendezvous store" if not is_master else "starting the rendezvous store"
    timeout = deadline.left(what)
    try:
        if not is_master:
            return c10d.TCPStore(rendezvous.address, rendezvous.port, None, False, timeout)
        listener = _listen(rendezvous.address, rendezvous.port)
        try:
            store = c10d.TCPStore(
                rendezvous.address,
                rendezvous.port,
                None,
                True,
                timeout,
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the socket now and closes it
        return store
    except RuntimeError as error:
        raise deadlines.translate(error, deadline, what) from None


def _listen(address: str, port: int) -> socket.socket:
    """A listening socket on ``address:port`` only (the store would otherwise listen everywhere)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(1024)
    except OSError as error:
        listener.close()
        raise errors.RefitError(
            f"cannot listen on {address}:{port} for the refit rendezvous: {error.strerror}"
        ) from None
    return listener


def local_address_towards(host: str) -> str:
    """The local address this host uses to reach ``host`` (no packet is sent)."""
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])
