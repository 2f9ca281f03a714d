"""How a fleet rank joins NeMo RL's refit world: the trainer's store, and the NCCL unique id the
trainer publishes there, whose key tells the trainer's :data:`Generation`.

Called by :meth:`NemoReceiver.connect <megafleet_protocol.refit.nemo.NemoReceiver.connect>` (and by
tests that check the rendezvous alone); :mod:`~megafleet_protocol.refit.nemo_collectives` builds the
communicator from what :func:`rendezvous` returns. The store client is built *with* the world size
(the trainer's master constructor counts its clients) and only once the store listens
(:func:`~megafleet_protocol.refit.rendezvous_store.wait_listening`); the id is the raw 128 bytes
under :data:`UNIQUE_ID_KEY` (NeMo >= 0.6) or else vLLM's pickle under :data:`VLLM_UNIQUE_ID_KEY`
(NeMo <= 0.5), decoded by :func:`decode_vllm_unique_id` without vLLM. docs/refit-protocol.md
("NeMo RL's collective") tells the wire.
"""

from __future__ import annotations

import _ctypes
import ctypes
import dataclasses
import io
import logging
import pickle
import threading
from typing import Any, Literal

from torch._C import _distributed_c10d as c10d  # Store classes: torch.distributed re-exports them untyped

from megafleet_protocol.refit import deadlines, errors, rendezvous_store

__all__ = [
    "UNIQUE_ID_BYTES",
    "UNIQUE_ID_KEY",
    "VLLM_UNIQUE_ID_KEY",
    "Generation",
    "NemoWorld",
    "decode_vllm_unique_id",
    "failed",
    "rendezvous",
]

log = logging.getLogger(__name__)

Generation = Literal["nemo", "vllm"]
"""How the trainer built its communicator: ``nemo`` (NeMo >= 0.6, raw id, broadcast warm-up) or
``vllm`` (vLLM's ``PyNcclCommunicator``, pickled id, all-reduce warm-up)."""

UNIQUE_ID_KEY = "nccl_unique_id"
"""NeMo >= 0.6: the trainer's rank 0 stores the NCCL unique id here, as its raw bytes."""
VLLM_UNIQUE_ID_KEY = "broadcast_from/0/0"
"""vLLM's ``StatelessProcessGroup``: the first object rank 0 broadcasts (the pickled unique id)."""
UNIQUE_ID_BYTES = 128
"""``NCCL_UNIQUE_ID_BYTES``."""
_POLL_FIRST_SECONDS = 0.002
_POLL_MAX_SECONDS = 0.05

_VLLM_ID_MODULE = "vllm.distributed.device_communicators.pynccl_wrapper"


# -- the unique id -----------------------------------------------------------------------------------


class _UniqueId(ctypes.Structure):
    """The layout of vLLM's ``ncclUniqueId`` (128 signed bytes), to unpickle it without vLLM."""

    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


class _UniqueIdUnpickler(pickle.Unpickler):
    """Allows exactly the two globals a pickled vLLM unique id needs, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (_VLLM_ID_MODULE, "ncclUniqueId"):
            return _UniqueId
        if (module, name) == ("_ctypes", "_unpickle"):
            return _ctypes._unpickle  # type: ignore[attr-defined]  # rebuilds a Structure from its __dict__ and bytes
        raise pickle.UnpicklingError(f"a NCCL unique id may not name {module}.{name}")


def decode_vllm_unique_id(raw: bytes) -> bytes:
    """The 128 bytes of a unique id pickled by vLLM's ``StatelessProcessGroup.broadcast_obj``
    (``_ctypes._unpickle(ncclUniqueId, ({}, <bytes>))``); :class:`ProtocolError` for anything else."""
    try:
        value = _UniqueIdUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, TypeError, ValueError, AttributeError) as error:
        raise errors.ProtocolError(f"the trainer's {VLLM_UNIQUE_ID_KEY!r} is not a NCCL unique id: {error}") from None
    if not isinstance(value, _UniqueId):
        raise errors.ProtocolError(f"the trainer's {VLLM_UNIQUE_ID_KEY!r} holds a {type(value).__name__}")
    return bytes(value)


# -- the world and its store ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NemoWorld:
    """NeMo's refit world as one fleet rank sees it.

    Attributes:
        address: the trainer rank 0's address (``get_master_address_and_port``), where its store listens.
        port: the store's port.
        world_size: ``T + I``: every trainer rank and every inference rank.
        rank: this rank, in ``T..world_size-1`` (the operator's rank offset plus the shard-local rank).
        trainer_world_size: ``T``; every trainer rank joins the collective (rank 0 is the root).
    """

    address: str
    port: int
    world_size: int
    rank: int
    trainer_world_size: int

    def __post_init__(self) -> None:
        if not 1 <= self.trainer_world_size <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is not an inference rank ({self.trainer_world_size}..{self.world_size - 1}) "
                f"of a NeMo world of {self.world_size} ranks with {self.trainer_world_size} trainer ranks"
            )


def rendezvous(
    world: NemoWorld, *, deadline: deadlines.Deadline, aborted: threading.Event | None = None
) -> tuple[c10d.Store, Generation, bytes]:
    """Join the trainer's store and read its unique id: the store client, the trainer's generation
    (:data:`UNIQUE_ID_KEY` present: ``nemo``; only :data:`VLLM_UNIQUE_ID_KEY`: ``vllm``) and the 128
    id bytes. Waits for the store and the id until ``deadline`` or ``aborted``."""
    aborted = aborted or threading.Event()
    rendezvous_store.wait_listening(
        world.address,
        world.port,
        deadline=deadline,
        aborted=aborted,
        what=f"the trainer's store at {world.address}:{world.port} accepted a connection",
    )
    what = f"connecting to the trainer's store at {world.address}:{world.port}"
    try:
        # world_size given: the trainer's master constructor counts this client (see the module doc)
        store = c10d.TCPStore(world.address, world.port, world.world_size, False, deadline.left(what))
    except RuntimeError as error:
        raise failed(error, deadline, what) from None
    generation = _wait_for_id_key(store, deadline, aborted)
    raw = _get(store, UNIQUE_ID_KEY if generation == "nemo" else VLLM_UNIQUE_ID_KEY, deadline)
    unique_id = raw if generation == "nemo" else decode_vllm_unique_id(raw)
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise errors.ProtocolError(f"the trainer's NCCL unique id has {len(unique_id)} bytes, not {UNIQUE_ID_BYTES}")
    log.info("joined NeMo's refit world at %s:%d as rank %d (%s)", world.address, world.port, world.rank, generation)
    return store, generation, unique_id


def _wait_for_id_key(store: c10d.Store, deadline: deadlines.Deadline, aborted: threading.Event) -> Generation:
    what = f"the trainer's NCCL unique id ({UNIQUE_ID_KEY!r} or {VLLM_UNIQUE_ID_KEY!r})"
    delay = _POLL_FIRST_SECONDS
    while True:
        deadline.left(what)
        try:
            if store.check([UNIQUE_ID_KEY]):
                return "nemo"
            if store.check([VLLM_UNIQUE_ID_KEY]):
                return "vllm"
        except RuntimeError as error:
            raise failed(error, deadline, what) from None
        if aborted.wait(min(delay, max(deadline.remaining, 0.0))):
            raise errors.RefitAborted(f"the refit was aborted while waiting for {what}")
        delay = min(delay * 2, _POLL_MAX_SECONDS)


def _get(store: c10d.Store, key: str, deadline: deadlines.Deadline) -> bytes:
    try:
        store.set_timeout(deadline.left(f"reading {key!r}"))
        value: bytes = store.get(key)
        return value
    except RuntimeError as error:
        raise failed(error, deadline, f"reading {key!r}") from None


def failed(error: RuntimeError, deadline: deadlines.Deadline, what: str) -> errors.RefitError:
    """``error`` itself if it is a :class:`RefitError` already, else :func:`deadlines.translate` of
    it (the step ``what`` failed, or ran out of time). Also used by
    :mod:`~megafleet_protocol.refit.nemo_collectives`."""
    return error if isinstance(error, errors.RefitError) else deadlines.translate(error, deadline, what)
