"""The engine's refits: run the receiver's half of the refit protocol against a suspended engine.

The agent's refit routes (:mod:`megafleet_engine.agent_server`) drive it through one
:class:`~megafleet_engine.refit_runner.controller.RefitController` per engine process; the protocol
itself (wire, communicator, receiver) is :mod:`megafleet_protocol.refit`, shared with the trainer.

* :mod:`~megafleet_engine.refit_runner.controller`: accepts a request and runs it as an attempt on
  its own thread (suspend, join, receive and write, resume), with a watchdog; reports progress;
  parks the communicator of a successful refit for the next one.
* :mod:`~megafleet_engine.refit_runner.megatron_native`: megatron-core's own receiver
  (``prepare_swap_model_weights``/``swap_model_weights``) joined to a megatron-core trainer's refit
  group; its swaps run as the controller's attempts.
* :mod:`~megafleet_engine.refit_runner.sinks`: where weights land (whole HF tensors, or the pieces of
  a megatron shard map), always with ``copy_``.
* :mod:`~megafleet_engine.refit_runner.watchdog`, :mod:`~megafleet_engine.refit_runner.progress`:
  the deadline thread and the attempt's record.

Importing this package (and the controller) does not import torch; the modules that need it load
when the first refit starts.
"""
