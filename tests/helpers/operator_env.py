"""The operator settings the end-to-end operator process runs with (``MEGAFLEET_<GROUP>_<FIELD>``
overrides, :meth:`megafleet.settings.OperatorSettings.from_environ`), so tests can await bounds
shorter than the production defaults."""

from __future__ import annotations

from megafleet import settings

__all__ = ["ENVIRONMENT", "TRAINER_GONE_SECONDS"]

TRAINER_GONE_SECONDS = 15.0
"""``session.trainer_gone_seconds`` of the e2e operator (production default: 60)."""

ENVIRONMENT = {settings.env_name("session", "trainer_gone_seconds"): f"{TRAINER_GONE_SECONDS:g}"}
"""Added to the operator process's environment by the ``operator`` fixture."""
