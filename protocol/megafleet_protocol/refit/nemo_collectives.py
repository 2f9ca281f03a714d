"""The communicator of NeMo RL's refit world on a fleet rank: NCCL as NeMo builds it, or gloo as
its CPU stand-in, each doing the warm-up the trainer's generation expects and the broadcasts from
world rank 0.

Called by :meth:`NemoReceiver.connect <megafleet_protocol.refit.nemo.NemoReceiver.connect>`, which
picks :class:`NcclCollective` (the NCCL communicator built from the trainer's unique id through
``torch.cuda.nccl``: no vLLM, no nccl4py) or :class:`GlooCollective` (over the same store, for CPU
tests; the trainer's side of that is a test stand-in, NeMo itself always uses NCCL), then uses it
through :class:`Collective`. Warm-up: ``nemo`` is a float32 ``[1]`` broadcast from rank 0 that
must arrive as 1.0; ``vllm`` an all-reduce (sum) of a float32 zero (docs/refit-protocol.md, "NeMo
RL's collective").
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d  # Store classes: torch.distributed re-exports them untyped

from megafleet_protocol.refit import deadlines, errors, nemo_rendezvous

__all__ = ["GLOO_PREFIX", "Collective", "GlooCollective", "NcclCollective"]

log = logging.getLogger(__name__)

GLOO_PREFIX = "megafleet/nemo-gloo/"
"""Store prefix of the gloo stand-in for NCCL (CPU tests): both ends must use the same one."""
_INIT_POLL_SECONDS = 0.05
"""How often the wait for NCCL's init (on its own thread) checks the deadline."""
_NCCL_POLL_SECONDS = 0.0002


class Collective(Protocol):
    """NeMo's world communicator as a receiver uses it: the warm-up, broadcasts from rank 0, teardown."""

    def warm_up(self, generation: nemo_rendezvous.Generation, deadline: deadlines.Deadline) -> None:
        """The first collective, the one the trainer's generation runs (the warm-up in the module doc)."""
        ...

    def broadcast(self, tensor: torch.Tensor, *, deadline: deadlines.Deadline, what: str) -> None:
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
        world: nemo_rendezvous.NemoWorld,
        *,
        deadline: deadlines.Deadline,
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
            raise nemo_rendezvous.failed(error, deadline, what) from None
        self._group = cast(_GlooGroup, group)
        self._aborted = False

    def warm_up(self, generation: nemo_rendezvous.Generation, deadline: deadlines.Deadline) -> None:
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

    def broadcast(self, tensor: torch.Tensor, *, deadline: deadlines.Deadline, what: str) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = deadline.left(what)
        self._run(lambda: self._group.broadcast([tensor], options), deadline, what)

    def _run(self, start: Callable[[], dist.Work], deadline: deadlines.Deadline, what: str) -> None:
        if self._aborted:
            raise errors.RefitAborted(f"the refit was aborted before {what}")
        try:
            start().wait()
        except RuntimeError as error:
            if self._aborted:
                raise errors.RefitAborted(f"the refit was aborted during {what}") from None
            raise nemo_rendezvous.failed(error, deadline, what) from None

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

    def __init__(
        self, world: nemo_rendezvous.NemoWorld, unique_id: bytes, *, device: torch.device, deadline: deadlines.Deadline
    ):
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
            thread.join(min(_INIT_POLL_SECONDS, max(deadline.remaining, 0.0)))
            deadline.left(what)
        if "error" in made:
            raise nemo_rendezvous.failed(made["error"], deadline, what)
        self._comm = made["comm"]
        self._stream: Any = cast(Any, torch.cuda.Stream)(device)

    def warm_up(self, generation: nemo_rendezvous.Generation, deadline: deadlines.Deadline) -> None:
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

    def broadcast(self, tensor: torch.Tensor, *, deadline: deadlines.Deadline, what: str) -> None:
        # root 0 of the communicator: torch.cuda.nccl broadcasts from its first input's rank, 0 here
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            self._nccl.broadcast([tensor], root=0, streams=[self._stream], comms=[self._live()])
        tensor.record_stream(self._stream)
        self._wait(deadline, what)

    def _wait(self, deadline: deadlines.Deadline, what: str) -> None:
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
