"""The fleet's agent token as the Refit and RefitSession controllers read it.

The reconcile creates the token once, in a Secret the fleet owns
(:func:`megafleet.reconcile.endpoints.agent_token`), and every call to a pod's agent carries it. The
controllers of :mod:`megafleet.refits` only read it, with :func:`read`.
"""

from __future__ import annotations

import base64

from megafleet import desired, kube, names
from megafleet.fleet_state import ownership


async def read(api: kube.Api, fleet: desired.ParsedFleet) -> str:
    """The fleet's agent token: '' before it exists or when the Secret of that name is not the
    fleet's own (a squatter's token is never sent to agents; the reconcile reports the name conflict)."""
    secret = await api.get("Secret", names.agent_secret(fleet.name), fleet.namespace)
    if secret is None or not ownership.owned(secret, fleet):
        return ""
    return base64.b64decode((secret.get("data") or {}).get(names.AGENT_TOKEN_KEY, "")).decode()
