"""The first reconcile step: the spec parses, its pods are ones the engine and the API server
accept (:mod:`.pod_checks`), and the objects it names exist.

Called by :func:`megafleet.reconcile.reconcile`. An invalid fleet gets InvalidSpec=True with every
problem, and a Warning Event only when it turns invalid; nothing else is touched.
"""

from __future__ import annotations

from megafleet import conditions, desired, kube, names
from megafleet.api import checks
from megafleet.objects import Object
from megafleet.reconcile import context, pod_checks, status


async def fleet(
    api: kube.Api, body: Object, notify: context.Notify, *, checked: pod_checks.Checked | None = None
) -> desired.ParsedFleet | None:
    """The parsed fleet, or None once its problems are reported. ``checked``: the operator's record
    of the pod checks by generation (None: check again)."""
    metadata = body["metadata"]
    generation = int(metadata.get("generation", 1))
    spec, problems = checks.parse_spec(body.get("spec") or {}, name=metadata["name"])
    parsed = None
    if spec is not None and not problems:
        parsed = desired.ParsedFleet(metadata["name"], metadata["namespace"], metadata["uid"], generation, spec)
        problems = (checked or pod_checks.Checked()).problems(parsed)
    if parsed is None or problems:
        message = "; ".join(f"{problem.field}: {problem.message}" for problem in problems)
        await _report_invalid(api, body, message, generation, notify)
        return None
    missing = await _missing_references(api, parsed)
    if missing:
        await _report_invalid(api, body, missing, generation, notify)
        return None
    return parsed


async def _missing_references(api: kube.Api, fleet: desired.ParsedFleet) -> str | None:
    """What the schema cannot check: objects the spec names must exist (those whose absence makes
    the API server refuse the pods; a missing PVC or pull Secret only keeps them waiting)."""
    pod = fleet.spec.pod
    if pod.service_account_name and await api.get("ServiceAccount", pod.service_account_name, fleet.namespace) is None:
        return (
            f"spec.pod.serviceAccountName: ServiceAccount {pod.service_account_name!r} does not exist in namespace "
            f"{fleet.namespace}"
        )
    if pod.priority_class_name and await api.get("PriorityClass", pod.priority_class_name) is None:
        return f"spec.pod.priorityClassName: PriorityClass {pod.priority_class_name!r} does not exist"
    ref = fleet.spec.frontend.api_key_secret
    if ref is None:
        return None
    if ref.name == names.agent_secret(fleet.name):
        return f"spec.frontend.apiKeySecret: Secret {ref.name!r} is this fleet's agent token; name a Secret of your own"
    secret = await api.get("Secret", ref.name, fleet.namespace)
    if secret is None:
        return f"spec.frontend.apiKeySecret: Secret {ref.name!r} does not exist in namespace {fleet.namespace}"
    if _agent_token(secret):
        return (
            f"spec.frontend.apiKeySecret: Secret {ref.name!r} is a fleet's agent token (its frontends would "
            "hand that fleet's agents to every client); name a Secret of your own"
        )
    if ref.key not in (secret.get("data") or {}):
        return f"spec.frontend.apiKeySecret: Secret {ref.name!r} has no key {ref.key!r}"
    return None


def _agent_token(secret: Object) -> bool:
    """Whether ``secret`` is some fleet's agent token: made by the operator for a MegatronGeneration."""
    metadata = secret["metadata"]
    labelled = (metadata.get("labels") or {}).get(names.LABEL_COMPONENT) == "agent-token"
    owners = metadata.get("ownerReferences") or []
    return labelled or any(owner.get("kind") == "MegatronGeneration" for owner in owners)


MESSAGE_CHARACTERS = 8192
"""The longest InvalidSpec message written (the schema allows a condition 32 KiB, and a problem
may quote what the user wrote)."""


async def _report_invalid(api: kube.Api, body: Object, message: str, generation: int, notify: context.Notify) -> None:
    if len(message) > MESSAGE_CHARACTERS:
        message = message[: MESSAGE_CHARACTERS - 3] + "..."
    current: Object = dict(body.get("status") or {})
    was_invalid = (conditions.find(current.get("conditions", []), conditions.INVALID_SPEC) or {}).get("status")
    await status.write(api, body, status.invalid(current, message, generation=generation, now=conditions.now()))
    if was_invalid != "True":
        notify("Warning", "InvalidSpec", message)
