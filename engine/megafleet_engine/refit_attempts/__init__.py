"""The engine's refit attempts: the receiver's half of every refit, run against a suspended engine in
the engine process.

The agent's refit routes (:mod:`megafleet_engine.agent_server`) drive it through one
:class:`~megafleet_engine.refit_attempts.controller.RefitController` (and one
:class:`~megafleet_engine.refit_attempts.megatron_group.NativeRefits`) per engine process; the
megafleet wire itself (wire, communicator, receiver) and NeMo's are :mod:`megafleet_protocol.refit`,
shared with the trainer.

* :mod:`~megafleet_engine.refit_attempts.controller`: admission (at most one attempt, a failed
  engine refuses, a repeated request answers its status), the dirty flag, what is parked for the
  next refit, and the membership of NeMo's world joined for a session;
* :mod:`~megafleet_engine.refit_attempts.attempt`: one attempt on its own thread, with a
  :mod:`~megafleet_engine.refit_attempts.watchdog`: suspend, receive or apply, verify, settle,
  commit, or fail;
* :mod:`~megafleet_engine.refit_attempts.sources`: one module per source of weights (the megafleet
  wire's rendezvous, a checkpoint, NeMo's collective, megatron-core's swap), each with its request,
  behind one protocol;
* :mod:`~megafleet_engine.refit_attempts.weight_target` and
  :mod:`~megafleet_engine.refit_attempts.sinks`: the live weights as sources see them, written in
  place with ``copy_``;
* :mod:`~megafleet_engine.refit_attempts.nemo_world`, :mod:`~megafleet_engine.refit_attempts.megatron_group`
  and :mod:`~megafleet_engine.refit_attempts.memberships`: worlds joined ahead of a session's refits
  (NeMo's, megatron-core's) and the probe of the trainer's store;
* :mod:`~megafleet_engine.refit_attempts.phases`: the attempt's record, as the status reports it.

Importing this package (and the controller) does not import torch; the modules that need it load
when the first refit starts.
"""
