"""The RL job's side of megafleet: what a trainer imports to push weights into a fleet.

:mod:`megafleet.sdk.trainer` holds :class:`~megafleet.sdk.trainer.WeightSender`, the trainer's end of
the refit protocol (DESIGN.md section 6). It needs torch (the ``engine`` extra) and never kopf: it
shares the wire protocol and the communicator with the engine's receiver
(:mod:`megafleet_engine.refit`), so both ends always speak the same version.
"""

from megafleet.sdk.trainer import SendReport, WeightSender, attempt_port
from megafleet_engine.refit.errors import ReceiverFailed, RefitError, RefitRejected, RefitTimeout

__all__ = [
    "ReceiverFailed",
    "RefitError",
    "RefitRejected",
    "RefitTimeout",
    "SendReport",
    "WeightSender",
    "attempt_port",
]
