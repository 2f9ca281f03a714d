"""The receiving side of NeMo RL's own refit collective: a fleet rank joins the world an unmodified NeMo
trainer builds with ``policy.init_collective(ip, port, world_size, train_world_size=T)`` and takes
the packed broadcasts of ``policy.broadcast_weights_for_collective()``.

Used by the engine's refit attempts (:mod:`megafleet_engine.refit_runner`) when a refit names NeMo's
format, and by tests that play NeMo's trainer from the same description. This is NeMo's protocol,
not megafleet's (:mod:`~megafleet_protocol.refit.wire`): no session, round, manifest, verdict or
done message; the trainer's rank 0 hosts a ``TCPStore``, publishes a 128-byte NCCL unique id under
one of two keys (which one tells the trainer's generation and so its warm-up collective), and each
refit is nothing but one broadcast from world rank 0 per bucket, in the order of the refit info
(``prepare_refit_info``) both ends hold. docs/refit-protocol.md ("NeMo RL's collective") tells the
whole wire; in short:

* **Rendezvous.** Connect to ``address:port`` as a non-master ``TCPStore`` client *with*
  ``world_size`` (the trainer's master constructor waits until ``world_size`` clients were counted;
  a client without it is not counted and the trainer times out), then wait for
  :data:`UNIQUE_ID_KEY` (raw 128 bytes, NeMo >= 0.6) or else :data:`VLLM_UNIQUE_ID_KEY` (a pickled
  ctypes ``ncclUniqueId`` from vLLM's ``StatelessProcessGroup.broadcast_obj``, NeMo <= 0.5), decoded
  by :func:`decode_vllm_unique_id` without vLLM.
* **Warm-up.** ``nemo``: a float32 ``[1]`` broadcast from rank 0 that must arrive as 1.0; ``vllm``:
  an all-reduce (sum) of a float32 zero.
* **Packing.** :func:`plan_buckets`: tensors in refit-info order, each's raw bytes back to back
  (no header, padding or alignment), a bucket closing right after the tensor that makes its size
  *strictly* exceed the target; :func:`unpack` cuts one received bucket back into tensors.

Transports: :class:`GlooCollective` over the same store (CPU tests; the trainer's side of that is a
test stand-in, NeMo itself always uses NCCL) and :class:`NcclCollective` (the NCCL communicator
built from the unique id, through ``torch.cuda.nccl``: no vLLM, no nccl4py).
"""

from __future__ import annotations

import _ctypes
import ctypes
import dataclasses
import importlib
import io
import logging
import math
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, cast

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d  # Store classes: torch.distributed re-exports them untyped

from megafleet_protocol.refit import communicator, errors, wire

__all__ = [
    "DEFAULT_BUFFER_MEMORY_RATIO",
    "MAX_BUCKET_BYTES",
    "UNIQUE_ID_BYTES",
    "UNIQUE_ID_KEY",
    "VLLM_UNIQUE_ID_KEY",
    "Collective",
    "Generation",
    "GlooCollective",
    "NcclCollective",
    "NemoReceiver",
    "NemoWorld",
    "Stats",
    "TensorSpec",
    "Write",
    "check_refit_info",
    "decode_vllm_unique_id",
    "nemo_bucket_bytes",
    "plan_buckets",
    "refit_info",
    "rendezvous",
    "unpack",
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
DEFAULT_BUFFER_MEMORY_RATIO = 0.02
"""NeMo's default ``NRL_REFIT_BUFFER_MEMORY_RATIO``: the bucket target is this share of the
trainer GPU's memory (:func:`nemo_bucket_bytes`)."""
MAX_BUCKET_BYTES = 5 * 1024**3
"""NeMo caps its bucket target at 5 GiB."""
GLOO_PREFIX = "megafleet/nemo-gloo/"
"""Store prefix of the gloo stand-in for NCCL (CPU tests): both ends must use the same one."""
_POLL_FIRST_SECONDS = 0.002
_POLL_MAX_SECONDS = 0.05
_NCCL_POLL_SECONDS = 0.0002

_VLLM_ID_MODULE = "vllm.distributed.device_communicators.pynccl_wrapper"


def nemo_bucket_bytes(total_memory_bytes: int, ratio: float = DEFAULT_BUFFER_MEMORY_RATIO) -> int:
    """NeMo's bucket target for a trainer GPU of ``total_memory_bytes``: ``min(int(total * ratio), 5 GiB)``.

    NeMo computes it from *its own* GPU (``torch.cuda.get_device_properties().total_memory`` and
    ``NRL_REFIT_BUFFER_MEMORY_RATIO``) unless the caller of ``broadcast_weights_for_collective``
    passes ``buffer_size_bytes``; the fleet cannot see that GPU, so its receivers take the number as
    an explicit setting and this helper documents the default (an H200: 143,771,336,704 B x 0.02 =
    2,875,426,734 B)."""
    return min(int(total_memory_bytes * ratio), MAX_BUCKET_BYTES)


# -- the refit info and the packed layout ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One entry of NeMo's refit info (``prepare_refit_info``): name, shape and dtype, in wire order."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def refit_info(info: Mapping[str, tuple[Sequence[int], torch.dtype | str]]) -> list[TensorSpec]:
    """NeMo's ``{name: (shape, dtype)}`` (dtype as a ``torch.dtype`` or its name, e.g. ``"bfloat16"``)
    as specs in the mapping's order, which is the wire's order."""
    specs = []
    for name, (shape, dtype) in info.items():
        resolved = dtype if isinstance(dtype, torch.dtype) else wire.parse_dtype(dtype.removeprefix("torch."))
        dims = tuple(int(size) for size in shape)
        if any(size < 0 for size in dims):
            raise ValueError(f"{name}: negative dimension in shape {list(dims)}")
        specs.append(TensorSpec(name, dims, resolved))
    return specs


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """NeMo's bucket boundaries: specs in order, a bucket closing right after the spec that makes its
    size strictly greater than ``bucket_bytes`` (so a bucket may end exactly at the target and go on,
    and a tensor larger than the target ends its bucket); the last, partial bucket is sent if it has
    any tensor, even of zero bytes. A pure function of the ordered sizes and the target."""
    if bucket_bytes < 0:
        raise ValueError(f"bucket size {bucket_bytes} is negative")
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        current.append(spec)
        size += spec.nbytes
        if size > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def unpack(bucket: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Cut a received ``uint8`` bucket into its tensors: views of it where the offset suits the
    dtype, copies where it does not (NeMo packs without alignment)."""
    expected = sum(spec.nbytes for spec in specs)
    if bucket.numel() != expected:
        raise errors.ProtocolError(f"a bucket of {bucket.numel()} bytes holds tensors of {expected} bytes")
    tensors = []
    offset = 0
    for spec in specs:
        piece = bucket.narrow(0, offset, spec.nbytes)
        offset += spec.nbytes
        if piece.storage_offset() % spec.dtype.itemsize:
            piece = piece.clone()
        tensors.append((spec.name, piece.view(spec.dtype).reshape(spec.shape)))
    return tensors


def check_refit_info(specs: Sequence[TensorSpec], required: Mapping[str, tuple[int, ...]]) -> None:
    """Raise :class:`~megafleet_protocol.refit.errors.ManifestMismatch` unless the trainer's refit
    info holds every tensor this rank needs (``required``: the sink's names and full shapes), each
    of that shape, and names no tensor twice. Tensors the rank does not hold are received and dropped."""
    problems = []
    seen: dict[str, TensorSpec] = {}
    twice: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            twice.add(spec.name)
        seen.setdefault(spec.name, spec)
    if twice:
        problems.append(f"the refit info names {len(twice)} tensors twice, e.g. {sorted(twice)[:3]}")
    absent = sorted(set(required) - set(seen))
    if absent:
        problems.append(f"the trainer's refit info lacks {len(absent)} parameters this rank holds, e.g. {absent[:3]}")
    reshaped = [
        f"{name} {list(seen[name].shape)} (expected {list(shape)})"
        for name, shape in sorted(required.items())
        if name in seen and seen[name].shape != tuple(shape)
    ]
    if reshaped:
        problems.append(f"{len(reshaped)} parameters have other shapes, e.g. {'; '.join(reshaped[:3])}")
    if problems:
        raise errors.ManifestMismatch("; ".join(problems))


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


# -- rendezvous ------------------------------------------------------------------------------------


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
    world: NemoWorld, *, deadline: communicator.Deadline, aborted: threading.Event | None = None
) -> tuple[c10d.Store, Generation, bytes]:
    """Join the trainer's store and read its unique id: the store client, the trainer's generation
    (:data:`UNIQUE_ID_KEY` present: ``nemo``; only :data:`VLLM_UNIQUE_ID_KEY`: ``vllm``) and the 128
    id bytes. Waits for the store and the id until ``deadline`` or ``aborted``."""
    aborted = aborted or threading.Event()
    _wait_listening(world, deadline, aborted)
    what = f"connecting to the trainer's store at {world.address}:{world.port}"
    try:
        # world_size given: the trainer's master constructor counts this client (see the module doc)
        store = c10d.TCPStore(world.address, world.port, world.world_size, False, deadline.left(what))
    except RuntimeError as error:
        raise _failed(error, deadline, what) from None
    generation = _wait_for_id_key(store, deadline, aborted)
    raw = _get(store, UNIQUE_ID_KEY if generation == "nemo" else VLLM_UNIQUE_ID_KEY, deadline)
    unique_id = raw if generation == "nemo" else decode_vllm_unique_id(raw)
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise errors.ProtocolError(f"the trainer's NCCL unique id has {len(unique_id)} bytes, not {UNIQUE_ID_BYTES}")
    log.info("joined NeMo's refit world at %s:%d as rank %d (%s)", world.address, world.port, world.rank, generation)
    return store, generation, unique_id


def _wait_listening(world: NemoWorld, deadline: communicator.Deadline, aborted: threading.Event) -> None:
    """Probe the store's port until it accepts (a TCPStore client overruns its own timeout and cannot
    be interrupted, so it is built only once the trainer listens)."""
    what = f"the trainer's store at {world.address}:{world.port} accepted a connection"
    delay = _POLL_FIRST_SECONDS
    while True:
        remaining = deadline.left(what).total_seconds()
        try:
            with socket.create_connection((world.address, world.port), timeout=min(remaining, 5.0)):
                return
        except OSError:
            pass
        if aborted.wait(min(delay, max(deadline.remaining, 0.0))):
            raise errors.RefitAborted(f"the refit was aborted before {what}")
        delay = min(delay * 2, _POLL_MAX_SECONDS)


def _wait_for_id_key(store: c10d.Store, deadline: communicator.Deadline, aborted: threading.Event) -> Generation:
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
            raise _failed(error, deadline, what) from None
        if aborted.wait(min(delay, max(deadline.remaining, 0.0))):
            raise errors.RefitAborted(f"the refit was aborted while waiting for {what}")
        delay = min(delay * 2, _POLL_MAX_SECONDS)


def _get(store: c10d.Store, key: str, deadline: communicator.Deadline) -> bytes:
    try:
        store.set_timeout(deadline.left(f"reading {key!r}"))
        value: bytes = store.get(key)
        return value
    except RuntimeError as error:
        raise _failed(error, deadline, f"reading {key!r}") from None


def _failed(error: RuntimeError, deadline: communicator.Deadline, what: str) -> errors.RefitError:
    if isinstance(error, errors.RefitError):
        return error
    if deadline.remaining <= communicator.DEADLINE_SLACK_SECONDS:
        return errors.RefitTimeout(f"the refit's {deadline.seconds:g} s deadline passed during {what}")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return errors.RefitError(f"{what} failed: {first_line}")


# -- transports ------------------------------------------------------------------------------------


class Collective(Protocol):
    """NeMo's world communicator as a receiver uses it: the warm-up, broadcasts from rank 0, teardown."""

    def warm_up(self, generation: Generation, deadline: communicator.Deadline) -> None:
        """The first collective, the one the trainer's generation runs (see the module doc)."""
        ...

    def broadcast(self, tensor: torch.Tensor, *, deadline: communicator.Deadline, what: str) -> None:
        """Receive ``tensor`` (in place) from world rank 0; done when this returns."""
        ...

    def abort(self) -> None:
        """Tear the communicator down so a blocked collective returns (any thread, idempotent)."""
        ...


class _GlooGroup(Protocol):
    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...
    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work: ...
    def abort(self) -> None: ...


class GlooCollective:
    """A gloo group of the whole world over the trainer's store (prefix :data:`GLOO_PREFIX`): the CPU
    stand-in for NeMo's NCCL communicator, which tests' trainers build the same way. Each op ends
    itself at the deadline (gloo's ``abort`` does not interrupt an op in progress)."""

    def __init__(
        self,
        store: c10d.Store,
        world: NemoWorld,
        *,
        deadline: communicator.Deadline,
        local_address: str,
        prefix: str = GLOO_PREFIX,
    ) -> None:
        distributed: Any = dist  # the option classes' constructors and fields are not in torch's stubs
        options = distributed.ProcessGroupGloo._Options()
        options._devices = [distributed.ProcessGroupGloo.create_device(hostname=local_address)]
        options._timeout = deadline.left("building the gloo group")
        what = "every rank joined the gloo group"
        try:
            group = distributed.ProcessGroupGloo(c10d.PrefixStore(prefix, store), world.rank, world.world_size, options)
        except RuntimeError as error:
            raise _failed(error, deadline, what) from None
        self._group = cast(_GlooGroup, group)
        self._aborted = False

    def warm_up(self, generation: Generation, deadline: communicator.Deadline) -> None:
        data = torch.zeros(1, dtype=torch.float32)
        if generation == "nemo":
            self.broadcast(data, deadline=deadline, what="the warm-up broadcast")
            _check_warm_up(data, 1.0)
            return
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        options.timeout = deadline.left("the warm-up all-reduce")
        self._run(lambda: self._group.allreduce([data], options), deadline, "the warm-up all-reduce")
        _check_warm_up(data, 0.0)

    def broadcast(self, tensor: torch.Tensor, *, deadline: communicator.Deadline, what: str) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = deadline.left(what)
        self._run(lambda: self._group.broadcast([tensor], options), deadline, what)

    def _run(self, start: Callable[[], dist.Work], deadline: communicator.Deadline, what: str) -> None:
        if self._aborted:
            raise errors.RefitAborted(f"the refit was aborted before {what}")
        try:
            start().wait()
        except RuntimeError as error:
            if self._aborted:
                raise errors.RefitAborted(f"the refit was aborted during {what}") from None
            raise _failed(error, deadline, what) from None

    def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        try:
            self._group.abort()
        except RuntimeError as error:
            log.debug("aborting the gloo group: %s", error)


class NcclCollective:
    """NeMo's own communicator: ``ncclCommInitRank(world_size, unique_id, rank)`` through
    ``torch.cuda.nccl`` (the NCCL torch ships), broadcasts with root 0 and the warm-up on a
    stream of this rank's device, every host wait polled against the deadline.

    Unverified on GPUs so far (the two-GPU run is a separate issue). Known limits: the init blocks
    without a timeout until every rank joined (it runs on its own thread here, so the deadline still
    ends the wait, but that thread stays blocked until NCCL gives up); :meth:`abort` calls
    ``ncclCommAbort`` through ``ctypes`` on the comm inside torch's capsule, which is then kept
    forever (its destructor would destroy the aborted comm a second time).
    """

    def __init__(self, world: NemoWorld, unique_id: bytes, *, device: torch.device, deadline: communicator.Deadline):
        nccl: Any = importlib.import_module("torch.cuda.nccl")  # lazily: only on a GPU rank (untyped)

        os.environ.setdefault("NCCL_CUMEM_ENABLE", "1")  # as NeMo's trainer workers (non-colocated)
        self._nccl: Any = nccl
        self._device = device
        self._aborted = False
        self._comm: Any = None
        self._lock = threading.Lock()
        torch.cuda.set_device(device)
        made: dict[str, Any] = {}

        def init() -> None:
            torch.cuda.set_device(device)
            try:
                made["comm"] = nccl.init_rank(world.world_size, unique_id, world.rank)
            except RuntimeError as error:
                made["error"] = error

        thread = threading.Thread(target=init, name="megafleet-nemo-nccl-init", daemon=True)
        thread.start()
        what = "initialising NCCL with the trainer's unique id"
        while thread.is_alive():
            thread.join(min(_POLL_MAX_SECONDS, max(deadline.remaining, 0.0)))
            deadline.left(what)
        if "error" in made:
            raise _failed(made["error"], deadline, what)
        self._comm = made["comm"]
        self._stream: Any = cast(Any, torch.cuda.Stream)(device)

    def warm_up(self, generation: Generation, deadline: communicator.Deadline) -> None:
        if generation == "nemo":
            data = torch.zeros(1, dtype=torch.float32, device=self._device)
            self.broadcast(data, deadline=deadline, what="the warm-up broadcast")
            _check_warm_up(data.cpu(), 1.0)
            return
        data = torch.zeros(1, dtype=torch.float32, device=self._device)
        with torch.cuda.stream(self._stream):
            self._nccl.all_reduce([data], op=self._nccl.SUM, streams=[self._stream], comms=[self._live()])
        self._wait(deadline, "the warm-up all-reduce")
        _check_warm_up(data.cpu(), 0.0)

    def broadcast(self, tensor: torch.Tensor, *, deadline: communicator.Deadline, what: str) -> None:
        # root 0 of the communicator: torch.cuda.nccl broadcasts from its first input's rank, 0 here
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            self._nccl.broadcast([tensor], root=0, streams=[self._stream], comms=[self._live()])
        tensor.record_stream(self._stream)
        self._wait(deadline, what)

    def _wait(self, deadline: communicator.Deadline, what: str) -> None:
        event: Any = cast(Any, torch.cuda.Event)()
        event.record(self._stream)
        while not event.query():
            if self._aborted:
                raise errors.RefitAborted(f"the refit was aborted during {what}")
            if deadline.passed:
                self.abort()
                raise errors.RefitTimeout(f"the refit's {deadline.seconds:g} s deadline passed during {what}")
            time.sleep(_NCCL_POLL_SECONDS)
        torch.cuda.current_stream(self._device).wait_stream(self._stream)

    def _live(self) -> Any:
        if self._aborted or self._comm is None:
            raise errors.RefitAborted("NeMo's NCCL communicator was aborted")
        return self._comm

    def abort(self) -> None:
        with self._lock:
            if self._aborted or self._comm is None:
                self._aborted = True
                return
            self._aborted = True
            capsule = self._comm
        _leaked.append(capsule)  # its destructor must never destroy the aborted comm
        try:
            _nccl_comm_abort(capsule)
        except (OSError, AttributeError, ValueError) as error:
            log.warning("could not abort NeMo's NCCL communicator: %s", error)


_leaked: list[Any] = []


def _nccl_comm_abort(capsule: Any) -> None:
    """``ncclCommAbort`` on the comm inside torch's capsule (``torch.cuda.nccl.init_rank``)."""
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    comm = get_pointer(capsule, get_name(capsule))
    library = ctypes.CDLL("libnccl.so.2")  # the one torch loaded (same soname)
    library.ncclCommAbort.argtypes = [ctypes.c_void_p]
    result = library.ncclCommAbort(comm)
    if result != 0:
        raise ValueError(f"ncclCommAbort returned {result}")


def _check_warm_up(data: torch.Tensor, expected: float) -> None:
    got = float(data[0])
    if got != expected:
        raise errors.ProtocolError(f"the warm-up collective gave {got}, expected {expected}: not NeMo's peer")


# -- the receiver ----------------------------------------------------------------------------------


Write = Callable[[list[tuple[str, torch.Tensor]]], int]
"""``write(tensors)``: copy one bucket's ``(name, tensor)`` pairs into the live parameters (the
tensors are views of the receive buffer, valid only during the call); returns how many it wrote.
NeMo's ``post_unpack_func``."""


@dataclasses.dataclass(frozen=True)
class Stats:
    """What one refit took in."""

    buckets: int
    bytes_received: int
    tensors_written: int


class NemoReceiver:
    """One fleet rank in NeMo's refit world: joined once (NeMo builds its world once per run and
    refits over it step after step), then :meth:`receive` per refit.

    Build with :meth:`connect`; :meth:`abort` may be called from any thread.
    """

    def __init__(
        self, store: c10d.Store, collective: Collective, *, world: NemoWorld, generation: Generation, unique_id: bytes
    ) -> None:
        self.world = world
        self.generation = generation
        self.unique_id = unique_id
        self.refits = 0
        self._store: c10d.Store | None = store  # kept open: the trainer's store counts its clients
        self._collective = collective
        self._aborted = False

    @classmethod
    def connect(
        cls,
        world: NemoWorld,
        *,
        backend: Literal["gloo", "nccl"],
        device: torch.device,
        deadline: communicator.Deadline,
        aborted: threading.Event | None = None,
        generation: Generation | None = None,
        local_address: str | None = None,
        gloo_prefix: str = GLOO_PREFIX,
    ) -> NemoReceiver:
        """Join the trainer's world as ``world.rank``: rendezvous, build the communicator, warm up.

        ``generation`` overrides the one the store's keys tell (never needed with a trainer that
        follows NeMo's rule, see docs/refit-protocol.md); ``local_address`` is where gloo binds
        (default: the route to the trainer)."""
        store, found, unique_id = rendezvous(world, deadline=deadline, aborted=aborted)
        chosen = generation or found
        collective: Collective
        if backend == "gloo":
            bind = local_address or communicator.local_address_towards(world.address)
            collective = GlooCollective(store, world, deadline=deadline, local_address=bind, prefix=gloo_prefix)
        else:
            collective = NcclCollective(world, unique_id, device=device, deadline=deadline)
        receiver = cls(store, collective, world=world, generation=chosen, unique_id=unique_id)
        try:
            collective.warm_up(chosen, deadline)
        except BaseException:
            receiver.abort()
            raise
        return receiver

    def receive(
        self,
        specs: Sequence[TensorSpec],
        *,
        bucket_bytes: int,
        device: torch.device,
        write: Write,
        deadline: communicator.Deadline,
        required: Mapping[str, tuple[int, ...]] | None = None,
    ) -> Stats:
        """Receive one refit: the buckets of ``specs`` (NeMo's refit info, in order) under the
        trainer's target ``bucket_bytes``, each unpacked and handed to ``write``.

        ``required`` (the sink's names and full shapes) is checked first: a refit info that lacks one
        or gives it another shape raises :class:`ManifestMismatch` before anything is received (the
        trainer has no way to hear it: its broadcasts then block until they time out)."""
        if required is not None:
            check_refit_info(specs, required)
        buckets = plan_buckets(specs, bucket_bytes)
        largest = max((sum(spec.nbytes for spec in bucket) for bucket in buckets), default=0)
        buffer = torch.empty(largest, dtype=torch.uint8, device=device)
        received = written = 0
        for index, bucket in enumerate(buckets):
            size = sum(spec.nbytes for spec in bucket)
            chunk = buffer.narrow(0, 0, size)
            what = (
                f"bucket {index + 1} of {len(buckets)} ({size} bytes, {bucket[0].name}"
                + (f" .. {bucket[-1].name}" if len(bucket) > 1 else "")
                + f"; bucket target {bucket_bytes} bytes)"
            )
            if self._aborted:
                raise errors.RefitAborted(f"the refit was aborted before {what}")
            self._collective.broadcast(chunk, deadline=deadline, what=what)
            received += size
            written += write(unpack(chunk, bucket))
            if buffer.is_cuda:  # the writer's copies may run on another thread's stream: the buffer is reused next
                torch.cuda.synchronize(device)
        self.refits += 1
        return Stats(len(buckets), received, written)

    @property
    def closed(self) -> bool:
        """Whether :meth:`abort` or :meth:`close` ended this membership (it cannot be rebuilt)."""
        return self._aborted

    def abort(self) -> None:
        """Tear the communicator down (any thread); the receiver is unusable afterwards."""
        self._aborted = True
        self._collective.abort()

    def close(self) -> None:
        """Leave the world: abort the communicator (NeMo's world cannot shrink; the trainer's next
        refit fails, as it would with a lost vLLM worker) and drop the store client."""
        self.abort()
        self._store = None
