"""Status merge-patches that would change nothing are not made.

Called by the fleet reconcile's status write (:func:`megafleet.reconcile.status.write`: an idle
reconcile writes nothing) and by the RefitSession controller (a waiting session is polled every
second).
"""

from __future__ import annotations

import json

from megafleet.objects import Object


def unchanged(current: Object, update: Object) -> bool:
    """Whether merging ``update`` into ``current`` changes nothing."""
    return _comparable(current) == _comparable({**current, **update})


def _comparable(status: Object) -> str:
    return json.dumps(status, sort_keys=True, default=str)
