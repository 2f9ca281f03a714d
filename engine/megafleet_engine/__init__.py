"""The pod side of megafleet: rank launcher, agent API, OpenAI frontend, backends, refit receiver.

Imports nothing from the operator package and never needs kopf, so the engine image stays small.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
