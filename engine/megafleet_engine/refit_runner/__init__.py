"""The refit receiver: new weights from the trainer, written in place into a suspended engine.

The agent's refit routes (:mod:`megafleet_engine.agent_server`) drive it through one
:class:`~megafleet_engine.refit_runner.controller.RefitController` per engine process; the trainer's side is
:mod:`megafleet_protocol.refit.sender`, which speaks the same protocol with the same modules. DESIGN.md
section 6 is the protocol this implements.

Modules, each small and with one job:

* :mod:`~megafleet_engine.refit_runner.controller`: accepts a request and runs it as an attempt on its own
  thread (suspend, join, receive and write, resume), with a watchdog; reports progress; parks the
  communicator of a successful refit for the next one.
* :mod:`~megafleet_protocol.refit.receiver`: the receiver's half of the wire protocol (manifest check,
  buckets, writes).
* :mod:`~megafleet_protocol.refit.communicator`: the trainer's session in its rendezvous store and the
  hand-built gloo/NCCL transfer group, kept from refit to refit while nothing changes, every wait
  bounded by the attempt's deadline.
* :mod:`~megafleet_protocol.refit.wire`: messages and bucket layout, shared with the trainer SDK.
* :mod:`~megafleet_engine.refit_runner.sinks`: where weights land (whole HF tensors, or the pieces of a
  megatron shard map), always with ``copy_``.
* :mod:`~megafleet_engine.refit_runner.watchdog`, :mod:`~megafleet_engine.refit_runner.progress`,
  :mod:`~megafleet_protocol.refit.errors`: the deadline thread, the attempt's record, the errors.

Importing this package (and the controller) does not import torch; the modules that need it load
when the first refit starts.
"""
