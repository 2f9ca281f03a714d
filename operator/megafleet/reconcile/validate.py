"""The first reconcile step: the spec parses, and the objects it names exist.

Called by :func:`megafleet.reconcile.reconcile`. An invalid fleet gets InvalidSpec=True with every
problem, and a Warning Event only when it turns invalid; nothing else is touched.
"""

from __future__ import annotations

from typing import Any

from megafleet import conditions, desired, kube
from megafleet.api import checks
from megafleet.reconcile import context, status

Object = dict[str, Any]


async def fleet(api: kube.Api, body: Object, notify: context.Notify) -> desired.ParsedFleet | None:
    """The parsed fleet, or None once its problems are reported."""
    metadata = body["metadata"]
    generation = int(metadata.get("generation", 1))
    spec, problems = checks.parse_spec(body.get("spec") or {}, name=metadata["name"])
    if spec is None or problems:
        message = "; ".join(f"{problem.field}: {problem.message}" for problem in problems)
        await _report_invalid(api, body, message, generation, notify)
        return None
    parsed = desired.ParsedFleet(metadata["name"], metadata["namespace"], metadata["uid"], generation, spec)
    missing = await _missing_references(api, parsed)
    if missing:
        await _report_invalid(api, body, missing, generation, notify)
        return None
    return parsed


async def _missing_references(api: kube.Api, fleet: desired.ParsedFleet) -> str | None:
    """What the schema cannot check: objects the spec names must exist."""
    ref = fleet.spec.frontend.api_key_secret
    if ref is None:
        return None
    secret = await api.get("Secret", ref.name, fleet.namespace)
    if secret is None:
        return f"spec.frontend.apiKeySecret: Secret {ref.name!r} does not exist in namespace {fleet.namespace}"
    if ref.key not in (secret.get("data") or {}):
        return f"spec.frontend.apiKeySecret: Secret {ref.name!r} has no key {ref.key!r}"
    return None


async def _report_invalid(api: kube.Api, body: Object, message: str, generation: int, notify: context.Notify) -> None:
    current: Object = dict(body.get("status") or {})
    was_invalid = (conditions.find(current.get("conditions", []), conditions.INVALID_SPEC) or {}).get("status")
    await status.write(api, body, status.invalid(current, message, generation=generation, now=conditions.now()))
    if was_invalid != "True":
        notify("Warning", "InvalidSpec", message)
