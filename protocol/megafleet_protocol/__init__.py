"""The contract shared by the operator and SDK (:mod:`megafleet`) and the engine (:mod:`megafleet_engine`).

Both sides import it; neither imports the other (import-linter contracts in pyproject.toml).

* :mod:`~megafleet_protocol.vocabulary`: the literals both sides speak (backend, transport, KV mode, ...).
* :mod:`~megafleet_protocol.agent_api`: the agent HTTP API's request and response models and paths.
* :mod:`~megafleet_protocol.env`: the ``MEGAFLEET_*`` variables the operator writes and the engine reads.
* :mod:`~megafleet_protocol.ports`: the fixed pod ports and the refit attempt's port rule.
* :mod:`~megafleet_protocol.refit`: the refit protocol's two halves (trainer sender, engine receiver).

Everything but :mod:`~megafleet_protocol.refit` depends on pydantic only; the refit part needs torch.
"""
