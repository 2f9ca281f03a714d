"""A timed-out wait over a collection shows each object briefly: what a CI log that keeps only the
start of the message needs (name, phase, node, conditions), not managed fields."""

from __future__ import annotations

from megafleet_dev import kube


def test_a_pod_is_shown_by_name_phase_node_and_conditions() -> None:
    pod = {
        "metadata": {"name": "f0-s0-p0", "managedFields": [{"manager": "megafleet-operator"}]},
        "spec": {"nodeName": "h200-c0-n0", "containers": [{"name": "engine"}]},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes"},
                {"type": "Ready", "status": "False"},
            ],
        },
    }
    assert kube.brief(pod) == {
        "name": "f0-s0-p0",
        "phase": "Pending",
        "node": "h200-c0-n0",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes"},
            {"type": "Ready", "status": "False"},
        ],
    }


def test_an_object_without_status_or_spec_is_still_named() -> None:
    assert kube.brief({"metadata": {"name": "x"}}) == {"name": "x", "phase": None, "node": None, "conditions": []}
