"""The engine core and its API-server processes, over local IPC (ZeroMQ + msgspec).

The rank process that owns the backend is the *core* (:mod:`.core`): it keeps the scheduler, the
agent, the refit attempts (:mod:`megafleet_engine.refit_attempts`) and the metrics, and spawns
``MEGAFLEET_API_SERVERS`` API-server processes (:mod:`megafleet_engine.api_server`) that share the
frontend's listening socket and own HTTP, tokenisation and detokenisation (:mod:`.client` is their
side of the channel). :mod:`.messages` is the whole contract between the two: requests in (batched
per event-loop turn), one outputs message per engine step out. Nothing here imports torch.
"""
