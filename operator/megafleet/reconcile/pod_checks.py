"""What the engine or the API server would refuse in the pods a valid spec makes, found before any exists.

Called by :func:`megafleet.reconcile.validate.fleet` after the spec parses: a problem found here makes
the fleet ``InvalidSpec`` like one of :func:`megafleet.api.checks.parse_spec`'s, naming the field. Pure.

* The engine's settings: the env each pod of a shard would get (:func:`megafleet.desired.shard_pods`)
  is read with the engine's own parser (:func:`megafleet_protocol.engine_settings.from_env`), so a
  ``MEGAFLEET_*`` value of ``spec.engine.env`` the engine refuses (``MEGAFLEET_REFIT_WAIT_SECONDS=-5``,
  ``MEGAFLEET_FUSED_KERNELS="rm -rf /"``) is reported naming the variable instead of becoming pods
  whose engines exit at start. What only the kubelet knows is left to the engine, which says why it
  exited in its termination message: a value from a Secret, a ConfigMap or a field of the pod
  (``valueFrom``, ``envFrom``), and a value holding ``$`` (the kubelet expands ``$(NAME)`` in it).
* The pod's annotations (``spec.pod.annotations`` and the operator's own): the API server refuses a
  pod whose annotations exceed 256 KiB in all, which the schema's per-value bound (64 KiB, 64 keys)
  allows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from megafleet import desired, planner
from megafleet.objects import Object
from megafleet_protocol import engine_settings, env

POD_IP = "10.0.0.1"
"""Stands for the pod IP the kubelet fills in (``MEGAFLEET_HOST``)."""
SECRET = "secret"
"""Stands for the API key the kubelet reads from ``spec.frontend.apiKeySecret`` (its key exists:
:mod:`.validate` checks it)."""
ANNOTATIONS_BYTES = 256 * 1024
"""The API server's bound on a pod's annotations, keys and values together
(``TotalAnnotationSizeLimitB``)."""


@dataclasses.dataclass
class Checked:
    """The problems found of each fleet's spec, kept for its generation: a fleet is checked once per
    spec change rather than at every reconcile (building a shard's pods takes up to a millisecond).
    Lives in the operator's runtime (:class:`megafleet.reconcile.context.Runtime`)."""

    found: dict[str, tuple[int, list[planner.Problem]]] = dataclasses.field(default_factory=dict)
    """By fleet uid: the generation checked and what was found."""

    def problems(self, fleet: desired.ParsedFleet) -> list[planner.Problem]:
        """:func:`problems` of ``fleet``, from the last check of its generation when there was one."""
        kept = self.found.get(fleet.uid)
        if kept is not None and kept[0] == fleet.generation:
            return kept[1]
        if len(self.found) >= KEPT_FLEETS:  # fleets deleted long ago: start again
            self.found.clear()
        found = problems(fleet)
        self.found[fleet.uid] = (fleet.generation, found)
        return found


KEPT_FLEETS = 10_000
"""The most fleets :class:`Checked` keeps the result of."""


def problems(fleet: desired.ParsedFleet) -> list[planner.Problem]:
    """Every problem of ``fleet``'s pods, each naming its field; empty when there is none."""
    placement = planner.ShardPlacement(
        clique=None,
        pods=tuple(planner.PodPlacement(f"node-{index}", 0) for index in range(fleet.layout.pods_per_shard)),
    )
    pods = desired.shard_pods(fleet, 0, placement)
    return annotation_problems(pods[0]) + engine_problems(fleet, pods)


def annotation_problems(pod: Object) -> list[planner.Problem]:
    """The pod's annotations against the API server's bound on their total size."""
    annotations: dict[str, str] = pod["metadata"].get("annotations") or {}
    size = sum(len(key.encode()) + len(value.encode()) for key, value in annotations.items())
    if size <= ANNOTATIONS_BYTES:
        return []
    message = (
        f"the engine pods' annotations would hold {size} bytes (keys and values, the operator's included); "
        f"the API server refuses more than {ANNOTATIONS_BYTES}"
    )
    return [planner.Problem("spec.pod.annotations", message)]


def engine_problems(fleet: desired.ParsedFleet, pods: list[Object]) -> list[planner.Problem]:
    """The engine's parser over each pod's env: each user variable it refuses on its own (at
    ``spec.engine.env[i]``), else what it refuses of them together, else what it refuses of the
    operator's own values (at ``spec``)."""
    user = {item.name: index for index, item in enumerate(fleet.spec.engine.env) if item.name.startswith(env.PREFIX)}
    for pod in pods:
        resolved = _resolved(pod, set(user))
        operator = {name: value for name, value in resolved.items() if name not in user}
        refused = _refused(operator)
        if refused is not None:
            return [planner.Problem("spec", f"the engine would refuse the settings the operator gives it: {refused}")]
        found = []
        for name, index in user.items():
            if name in resolved:
                refused = _refused({**operator, name: resolved[name]})
                if refused is not None:
                    found.append(planner.Problem(f"spec.engine.env[{index}]", refused))
        if not found:
            refused = _refused(resolved)
            if refused is not None:
                found.append(planner.Problem("spec.engine.env", refused))
        if found:
            return found
    return []


def _refused(environ: Mapping[str, str]) -> str | None:
    """Why the engine would refuse ``environ``, or None."""
    try:
        engine_settings.from_env(environ)
    except engine_settings.SettingsError as error:
        return str(error)
    return None


def _resolved(pod: Object, user: set[str]) -> dict[str, str]:
    """The ``MEGAFLEET_*`` variables of ``pod``'s engine as the engine would see them, where that is
    known before the pod runs: the operator's values unescaped (it writes ``$`` as ``$$``), the pod IP
    and the API key stood in for, the user's ``value``\\ s without ``$``; the rest left out."""
    resolved = {}
    for item in pod["spec"]["containers"][0]["env"]:
        name: str = item["name"]
        if not name.startswith(env.PREFIX):
            continue
        source = item.get("valueFrom")
        if name in user:
            if source is None and "$" not in item.get("value", ""):
                resolved[name] = item.get("value", "")
        elif source is None:
            resolved[name] = str(item.get("value", "")).replace("$$", "$")
        elif "fieldRef" in source:
            resolved[name] = POD_IP
        elif "secretKeyRef" in source:
            resolved[name] = SECRET
    return resolved
