"""Scaling a fleet while NeMo RL's trainer holds its world, end to end (docs/nemo-rl.md, "Losing and
regaining shards"; :mod:`megafleet.fleet_state.hold`).

The real local control plane, the operator and tiny CPU engine pods; NeMo RL's trainer is
:class:`helpers.nemo_held_trainer.Trainer` (its policy side in a Ray actor, NeMo's fleet-health
monitor attached, each training step NeMo's ``_sync_weights``).

``kubectl scale 2 -> 3`` during the session: shard 2 is placed at once, outside the trainer's world,
Stale while the fleet stays held; the next step's rebuild names it and its refit makes it current and
served. ``kubectl scale 3 -> 2``: shard 2 keeps its place in the world (``RefitSessionHeld`` says it
leaves at the trainer's next rebuild), the monitor retires it, the next step's rebuild leaves it out
and the operator removes it; no refit fails. One fleet and one Ray for the whole module.
"""

from __future__ import annotations

from pathlib import Path

from helpers import nemo_fleet_health, nemo_serving, refit_e2e
from helpers import nemo_held_trainer as held
from megafleet_dev import kube

WAIT = held.WAIT
ShardState = nemo_fleet_health.ShardState


def test_a_scale_out_joins_and_a_scale_in_leaves_the_trainers_world_at_its_next_rebuild(
    operator: Path, kube_admin: kube.Kube, namespace: str, kubeconfig: Path, local_ray: None
) -> None:
    fleet_path = held.fleet_path(namespace)
    pods = f"/api/v1/namespaces/{namespace}/pods"
    kube_admin.create(refit_e2e.fleets(namespace), refit_e2e.tiny_fleet(refit={"bucketSizeMiB": 1}))
    with held.training(namespace, kubeconfig, shards=2) as trainer:
        generation, monitor = trainer.generation, trainer.monitor
        [first] = kube_admin.list(held.sessions(namespace))["items"]

        # kubectl scale 2 -> 3 while held: shard 2 placed outside the world, Stale, the hold kept
        kube_admin.patch(f"{fleet_path}/scale", {"spec": {"replicas": 3}})
        stale = kube_admin.wait(
            fleet_path, lambda o: held.shard(o, 2).get("phase") == "Stale", timeout=WAIT, what="shard 2 placed, Stale"
        )
        assert stale is not None and stale["status"]["refit"]["session"] == first["metadata"]["name"]
        assert "spec.replicas 3: shard 2 joins at the trainer's next rebuild" in held.message(stale), held.message(
            stale
        )
        assert held.shard(stale, 2).get("weightVersion") in (None, 0), held.shard(stale, 2)

        # the next step's rebuild names it, its refit makes it current and served
        assert trainer.step(2), "rebuilt over the three shards"
        assert monitor.state_of(2) is ShardState.HEALTHY and ("mark_loaded", 2) in monitor.calls, monitor.calls
        [second] = kube_admin.list(held.sessions(namespace))["items"]
        assert second["spec"]["shards"] == [0, 1, 2] and second["spec"]["nemoCollective"]["worldSize"] == 5
        current = kube_admin.wait(
            fleet_path,
            lambda o: all(
                (held.shard(o, i).get("phase"), held.shard(o, i).get("weightVersion")) == ("Ready", 2) for i in range(3)
            ),
            timeout=WAIT,
            what="three shards Ready at version 2",
        )
        assert current is not None
        nemo_serving.check_serves(generation, 2, version=2)

        # kubectl scale 3 -> 2 while held: shard 2 stays in the world until the next step's rebuild
        kube_admin.patch(f"{fleet_path}/scale", {"spec": {"replicas": 2}})
        leaving = kube_admin.wait(
            fleet_path,
            lambda o: "spec.replicas 2: shard 2 leaves at the trainer's next rebuild" in held.message(o),
            timeout=WAIT,
            what="RefitSessionHeld naming the leaving shard",
        )
        assert leaving is not None and kube_admin.get(f"{pods}/tiny-s2-p0") is not None, "kept while in the world"
        assert trainer.step(3), "rebuilt without shard 2"
        assert monitor.state_of(2) is ShardState.RETIRED and trainer.built == [0, 1]
        [third] = kube_admin.list(held.sessions(namespace))["items"]
        assert third["spec"]["shards"] == [0, 1]
        kube_admin.wait(f"{pods}/tiny-s2-p0", lambda o: o is None, timeout=WAIT, what="shard 2 removed")
        settled = kube_admin.wait(
            fleet_path,
            lambda o: "join" not in held.message(o) and "leave" not in held.message(o) and o is not None,
            timeout=WAIT,
            what="nothing waits",
        )
        assert settled is not None and [s["index"] for s in settled["status"]["shards"]] == [0, 1]
    held.refits_succeeded(kube_admin, namespace, range(1, 4))
