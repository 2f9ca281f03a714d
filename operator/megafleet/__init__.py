"""megafleet: a Kubernetes operator for LLM generation fleets serving reinforcement-learning jobs.

This package holds the operator side (API models, planner, reconcile handlers, refit
orchestration, RL-job SDK). The pod side lives in :mod:`megafleet_engine`; the local control
plane used for development and tests lives in :mod:`megafleet_dev`.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
