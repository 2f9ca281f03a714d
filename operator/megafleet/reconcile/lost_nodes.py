"""Shards on a lost node: found in the watch-fed node index, their pods deleted (forced where no
kubelet can confirm it), and re-placed by :func:`.shards.place` like any shard whose pods are gone.

Called by :func:`megafleet.reconcile.reconcile` right after :func:`.shards.heal` (also while a refit
runs or a session holds the fleet: a shard on a lost node is broken either way), by the pacing probe
of a settled fleet (:func:`due`) and by the node-event handler of :mod:`megafleet.handlers`
(:func:`fleets_on`). Reads the watch-fed :mod:`.cache` only: the operator always runs one; the
in-process reconciles of the tests, which have none, leave lost nodes to Kubernetes.

When a pod's node (bound, else pinned) counts as lost, decided by :func:`loss` (pure):

- **deleted**: no Node of that name. Kubernetes' pod garbage collector force-deletes such orphans
  only after a 40 s quarantine and its next sweep (about 100 s in the node drill); done here at once.
- **unreachable**: the node lifecycle controller's ``node.kubernetes.io/unreachable:NoExecute``
  taint (the kubelet stopped posting status) has been on (its ``timeAdded``) longer than the pod
  tolerates it: the ``tolerationSeconds`` of the pod's matching toleration. The API server's
  DefaultTolerationSeconds admission gives every pod 300 s unless the fleet's tolerations bring one;
  one without seconds tolerates the taint for ever; a pod with none is lost at once. That is the
  moment Kubernetes' taint eviction deletes the pod, but with no kubelet to confirm it the pod would
  stay Terminating until the node is deleted, so the deletion here is forced.
- **out of service**: ``node.kubernetes.io/out-of-service`` (an administrator declares the node shut
  down, the non-graceful node shutdown of Kubernetes), with the same toleration rule.

``node.kubernetes.io/not-ready`` (a kubelet that still talks but reports NotReady) is left to
Kubernetes: that kubelet confirms the taint eviction, and :func:`.shards.heal` re-places the shard
once its pods are gone. A shard is whole or absent: its pods on lost nodes are force-deleted, the
others deleted gracefully, and the restart is counted once, with the node in its ``lastError`` and
in a ``NodeLost`` Warning Event.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping

from megafleet import desired, names
from megafleet.fleet_state import ownership
from megafleet.fleet_state import pods as pod_view
from megafleet.objects import Object
from megafleet.reconcile import cache as watch_cache
from megafleet.reconcile import compute_domains, context

UNREACHABLE = "node.kubernetes.io/unreachable"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
LOST_TAINTS = (UNREACHABLE, OUT_OF_SERVICE)
"""NoExecute taints that say no kubelet will confirm a pod's deletion."""


@dataclasses.dataclass(frozen=True)
class Loss:
    """Why one pod's node counts as lost."""

    node: str
    why: str
    """``deleted``, or the taint and since when (``unreachable since 2026-12-02T01:00:00Z``)."""

    def __str__(self) -> str:
        return f"node {self.node} {self.why}"


@dataclasses.dataclass(frozen=True)
class LostShard:
    """A shard with at least one pod on a lost node."""

    shard: int
    lost: dict[str, Loss]
    """Pod name to its node's loss (force-deleted)."""
    others: list[str]
    """The shard's other pods (deleted gracefully: their kubelets answer)."""


def loss(node: str, nodes: Mapping[str, Object], tolerations: list[Object], now: datetime.datetime) -> Loss | None:
    """Whether ``node`` is lost for a pod with ``tolerations`` at ``now`` (see the module's rules)."""
    found = nodes.get(node)
    if found is None:
        return Loss(node, "deleted")
    for taint in (found.get("spec") or {}).get("taints") or []:
        if taint.get("key") not in LOST_TAINTS or taint.get("effect") != "NoExecute":
            continue
        added = _time(taint.get("timeAdded"))
        if added is None:
            continue  # a hand-made taint with no start: Kubernetes' eviction has no deadline for it either
        tolerated = _tolerated_seconds(tolerations, taint)
        if tolerated is None:
            continue
        if now >= added + datetime.timedelta(seconds=tolerated):
            what = "unreachable" if taint["key"] == UNREACHABLE else "out of service"
            return Loss(node, f"{what} since {taint['timeAdded']}")
    return None


def _tolerated_seconds(tolerations: list[Object], taint: Object) -> float | None:
    """How long a pod with ``tolerations`` stays on a node with ``taint`` (NoExecute): 0 when none
    matches, None (for ever) when a matching one has no ``tolerationSeconds``, else the longest;
    the taint-eviction controller's rule."""
    seconds: list[float] = []
    for toleration in tolerations:
        if not _matches(toleration, taint):
            continue
        if toleration.get("tolerationSeconds") is None:
            return None
        seconds.append(max(0.0, float(toleration["tolerationSeconds"])))
    return max(seconds, default=0.0)


def _matches(toleration: Object, taint: Object) -> bool:
    """The core API's rule on raw JSON (as :func:`.inventory.tolerates` on the fleet's models)."""
    effect = toleration.get("effect")
    if effect and effect != taint.get("effect"):
        return False
    operator = toleration.get("operator") or "Equal"
    if not toleration.get("key"):
        return operator == "Exists"
    if toleration["key"] != taint.get("key"):
        return False
    return operator == "Exists" or (toleration.get("value") or "") == (taint.get("value") or "")


def _time(text: object) -> datetime.datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def lost_shards(pods: Iterable[Object], by_name: Mapping[str, Object], now: datetime.datetime) -> list[LostShard]:
    """The shards of ``pods`` (one fleet's, terminating ones included) with a pod on a lost node,
    by shard index; ``by_name``: the cluster's nodes by name. A pod bound to no node and pinned to
    none is on no node yet. No nodes at all is read as an index not filled, never as every node
    deleted: nothing is lost then."""
    if not by_name:
        return []
    members: dict[int, list[Object]] = {}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if names.LABEL_SHARD in labels:
            members.setdefault(int(labels[names.LABEL_SHARD]), []).append(pod)
    found = []
    for shard, shard_pods in sorted(members.items()):
        lost: dict[str, Loss] = {}
        for pod in shard_pods:
            node = (pod.get("spec") or {}).get("nodeName") or pod_view.pinned_node(pod)
            gone = loss(node, by_name, (pod.get("spec") or {}).get("tolerations") or [], now) if node else None
            if gone is not None:
                lost[pod["metadata"]["name"]] = gone
        if lost:
            others = [pod["metadata"]["name"] for pod in shard_pods if pod["metadata"]["name"] not in lost]
            found.append(LostShard(shard, lost, others))
    return found


def fleets_on(cache: watch_cache.Cache | None, node: str) -> list[tuple[str, str]]:
    """The (namespace, fleet) of every fleet with a pod bound or pinned to ``node``, from the cache."""
    if cache is None or not cache.ready:
        return []
    found = set()
    for key, pods in cache.indexes[watch_cache.FLEET_PODS].items():
        for pod in pods:
            if node in ((pod.get("spec") or {}).get("nodeName"), pod_view.pinned_node(pod)):
                found.add(key)
    return sorted(found)


def _owned_pods(cache: watch_cache.Cache, fleet: desired.ParsedFleet) -> list[Object]:
    return ownership.only_owned(cache.fleet_objects("Pod", fleet.namespace, fleet.name), fleet)


def due(cache: watch_cache.Cache | None, fleet: desired.ParsedFleet) -> bool:
    """Whether ``fleet`` has a shard on a lost node now (the pacing probe: a reconcile is due)."""
    if cache is None or not cache.ready:
        return False
    return bool(lost_shards(_owned_pods(cache, fleet), cache.nodes_by_name(), _now()))


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


async def release(ctx: context.FleetContext) -> None:
    """Delete the pods of every shard on a lost node (forced on the lost node, graceful elsewhere),
    count its restart once (with the node as its ``lastError``) and announce it; the shard is then
    terminating, and placed again once its pods are gone."""
    cache = ctx.runtime.cache
    if cache is None or not cache.ready:
        return
    for found in lost_shards(_owned_pods(cache, ctx.fleet), cache.nodes_by_name(), _now()):
        first = next(iter(found.lost.values()))
        placed = found.shard in ctx.shards.pods  # not yet counted: not terminating
        ctx.shards.take(found.shard)
        for pod in sorted(found.lost):
            await ctx.api.delete("Pod", pod, ctx.fleet.namespace, grace_seconds=0)
        if not placed:
            continue  # deleting already (our own earlier pass, or Kubernetes' eviction): only forced again
        for pod in found.others:
            await ctx.api.delete("Pod", pod, ctx.fleet.namespace)
        await compute_domains.remove(ctx, found.shard)  # its IMEX domain goes with it
        count = ctx.restarts.get(found.shard, (0, None))[0] + 1
        ctx.restarts[found.shard] = (count, str(first))
        ctx.notify(
            "Warning",
            "NodeLost",
            f"shard {found.shard} is re-placed (restart {count}): {first}; "
            f"pods force-deleted: {', '.join(sorted(found.lost))}",
        )
