"""The Refit controller's in-flight modes against an in-memory API and fake members
(:mod:`helpers.refit_world`): every member's request carries the modes; a member that cannot keep
makes every member drain and the Refit says KeepUnavailable; the members' reports are summed into the
Refit's status and the fleet's; a bucket that did not verify fails the Refit naming shard, pod, bucket
and first tensor; members of NeMo's wire whose digests disagree fail it too; ``staging: required``
that the engines cannot honour fails before any member is told to receive."""

from __future__ import annotations

from typing import Any, cast

from helpers.refit_world import NS, NoAgents, World, condition
from megafleet import agent_client
from megafleet.objects import Object
from megafleet.refits import modes, refit_status
from megafleet_protocol import agent_api

RENDEZVOUS = {"rendezvous": {"address": "10.0.0.1", "port": 29600}}
KEEPS = agent_api.Capabilities(keep_modes=["persist", "recompute"], staging_bytes=1 << 20)


def sent(world: World) -> list[Object]:
    """What every refit request put on the wire, in the order sent."""
    return [agent_client._json(body) for _, body in world.agents.starts]


def modes_of(body: Object) -> dict[str, Any]:
    return {key: body.get(key) for key in ("suspendMode", "kvCacheMode", "staging", "integrity")}


def run(world: World, name: str) -> Object:
    """Advance the Refit until it finishes (at most a few steps)."""
    for _ in range(6):
        status: Object = world.advance_refit(name)["status"]
        if status["phase"] in refit_status.FINISHED:
            return status
    raise AssertionError(f"{name} did not finish: {status}")


def test_every_member_is_told_the_modes_the_refit_resolved() -> None:
    world = World(refit={"inFlight": "keep", "staging": "auto", "integrity": "checksum"})
    world.start()
    for ip in world.pod_ips().values():
        world.agents.capabilities[ip] = KEEPS
    world.refit(1, {"checkpoint": {"path": "/ckpt/1"}})
    world.api.objects[("Refit", NS, "tiny-v1")]["spec"]["kvCacheMode"] = "recompute"

    done = run(world, "tiny-v1")

    assert done["phase"] == "Succeeded", done
    # A checkpoint load carries no bucket; each rank digests what it loaded, for the shards' agreement.
    expected = {"suspendMode": "keep", "kvCacheMode": "recompute", "staging": "auto", "integrity": "checksum"}
    assert [modes_of(body) for body in sent(world)] == [expected, expected]
    assert done["inFlight"]["requested"] == done["inFlight"]["effective"] == "keep"
    assert "KeepUnavailable" not in {c["type"] for c in done["conditions"]}


def test_a_rendezvous_refit_asks_for_the_fleets_integrity() -> None:
    world = World(refit={"integrity": "checksum"})
    world.start()
    world.refit(1, RENDEZVOUS)

    assert run(world, "tiny-v1")["phase"] == "Succeeded"
    assert {body.get("integrity") for body in sent(world)} == {"checksum"}


def test_a_fleet_at_its_defaults_keeps_and_stages_without_integrity() -> None:
    world = World()
    world.start()
    for ip in world.pod_ips().values():
        world.agents.capabilities[ip] = KEEPS
    world.refit(1, RENDEZVOUS)

    done = run(world, "tiny-v1")
    assert done["phase"] == "Succeeded"
    expected = {"suspendMode": "keep", "kvCacheMode": "persist", "staging": "auto", "integrity": None}
    assert [modes_of(body) for body in sent(world)] == [expected, expected]
    assert done["inFlight"]["requested"] == done["inFlight"]["effective"] == "keep"
    assert "KeepUnavailable" not in {c["type"] for c in done["conditions"]}


def test_a_fleet_at_its_defaults_on_engines_too_old_to_keep_drains_sends_nothing_new_and_says_so() -> None:
    """Engines whose state lists no capabilities (built before keep and staging) are sent what they
    understand (drain, the KV mode); the Refit says why it drained, nothing silently downgraded."""
    world = World()
    world.start()
    world.refit(1, RENDEZVOUS)

    done = run(world, "tiny-v1")
    assert done["phase"] == "Succeeded"
    expected = {"suspendMode": "drain", "kvCacheMode": "persist", "staging": None, "integrity": None}
    assert [modes_of(body) for body in sent(world)] == [expected, expected]
    unavailable = condition(world.api.objects[("Refit", NS, "tiny-v1")], refit_status.KEEP_UNAVAILABLE)
    assert (unavailable["status"], unavailable["reason"]) == ("True", modes.BACKEND_CANNOT_KEEP)
    assert (done["inFlight"]["requested"], done["inFlight"]["effective"]) == ("keep", "drain")
    assert done["staging"]["effective"] == "inPlace" and "cannot stage" in done["staging"]["reason"]


def test_a_member_that_cannot_keep_makes_every_member_drain_and_the_refit_says_so() -> None:
    world = World(refit={"inFlight": "keep"})
    world.start()
    ips = world.pod_ips()
    world.agents.capabilities[ips["tiny-s0-p0"]] = KEEPS  # shard 1's engine keeps nothing
    world.refit(1, RENDEZVOUS)

    running = world.advance_refit("tiny-v1")["status"]
    done = run(world, "tiny-v1")

    assert [body["suspendMode"] for body in sent(world)] == ["drain", "drain"]
    unavailable = condition(world.api.objects[("Refit", NS, "tiny-v1")], refit_status.KEEP_UNAVAILABLE)
    assert (unavailable["status"], unavailable["reason"]) == ("True", modes.BACKEND_CANNOT_KEEP)
    assert unavailable["message"] == (
        f"shard 1 (pod tiny-s1-p0) cannot keep sequences across a refit; every member drained "
        f"({modes.DRAIN_WITHOUT_CONDITION})"
    )
    assert running["inFlight"]["effective"] == "drain", "said while it runs"
    assert done["phase"] == "Succeeded"
    assert (done["inFlight"]["requested"], done["inFlight"]["effective"]) == ("keep", "drain")
    assert done["inFlight"]["reason"] == unavailable["message"]
    assert world.fleet()["status"]["refit"]["lastInFlight"] == {
        "mode": "drain",
        "kvCacheMode": "persist",
        "staging": "inPlace",
    }


def test_the_members_reports_are_summed_into_the_refit_and_the_fleet() -> None:
    world = World(refit={"inFlight": "keep", "staging": "auto"})
    world.start()
    for index, ip in enumerate(world.pod_ips().values()):
        world.agents.capabilities[ip] = KEEPS
        world.agents.reports[ip] = {
            "in_flight": agent_api.InFlightReport(
                requested="keep", effective="keep", kv_cache_mode="persist", kept=3 + index
            ),
            "staging": agent_api.StagingReport(requested="auto", effective="staged", bytes=1 << 20),
            "pause": agent_api.PauseReport(
                stall_milliseconds=10.0 + 4 * index, gate_closed_milliseconds=12.0, switch_milliseconds=2.0
            ),
        }
    world.refit(1, RENDEZVOUS)

    done = run(world, "tiny-v1")

    assert done["phase"] == "Succeeded", done
    assert (done["inFlight"]["effective"], done["inFlight"]["kept"]) == ("keep", 7)
    assert done["staging"] == {"requested": "auto", "effective": "staged", "bytes": 1 << 20}
    assert done["pause"] == {
        "stallP50Milliseconds": 10,
        "stallMaxMilliseconds": 14,
        "gateClosedMaxMilliseconds": 12,
        "recomputeMaxMilliseconds": 0,
        "shards": [{"shard": 0, "stallMilliseconds": 10}, {"shard": 1, "stallMilliseconds": 14}],
    }
    fleet_refit = world.fleet()["status"]["refit"]
    assert fleet_refit["lastInFlight"] == {"mode": "keep", "kvCacheMode": "persist", "staging": "staged"}
    assert fleet_refit["lastStallMilliseconds"] == 14


def test_a_bucket_that_did_not_verify_fails_the_refit_naming_shard_pod_bucket_and_first_tensor() -> None:
    world = World(refit={"integrity": "checksum"})
    world.start()
    ip = world.pod_ips()["tiny-s1-p0"]
    world.agents.refit_phase[ip] = "failed"
    world.agents.reports[ip] = {
        "error": "refit to v1 failed before the switch",
        "verification": agent_api.VerificationReport(
            integrity="checksum",
            method="trainerDigest",
            buckets=4,
            mismatch=agent_api.BucketMismatch(bucket=2, first_tensor="model.layers.0.mlp.up_proj.weight"),
        ),
    }
    world.refit(1, RENDEZVOUS)

    done = run(world, "tiny-v1")

    assert done["phase"] == "Failed" and done["attempts"] == 2, "retried once, as any failed attempt"
    failed = condition(world.api.objects[("Refit", NS, "tiny-v1")], "Failed")
    assert failed["reason"] == refit_status.BUCKET_MISMATCH
    assert failed["message"] == (
        "attempt 2 failed: shard 1, pod tiny-s1-p0: bucket 2 (first tensor model.layers.0.mlp.up_proj.weight) "
        "did not match its digest (refit to v1 failed before the switch)"
    )
    assert done["verification"]["mismatch"] == {
        "shard": 1,
        "pod": "tiny-s1-p0",
        "bucket": 2,
        "firstTensor": "model.layers.0.mlp.up_proj.weight",
    }
    assert world.fleet()["status"]["refit"].get("active") is None
    assert world.pod_ips()["tiny-s0-p0"] in world.agents.aborts, "the other member was stopped at once"


def test_members_of_nemos_wire_whose_digests_disagree_fail_the_refit_and_break_the_session(world: World) -> None:
    world.session()
    world.refit_info()
    world.joined()
    ips = world.pod_ips()
    for ip, digests in ((ips["tiny-s0-p0"], ["aa", "bb"]), (ips["tiny-s1-p0"], ["aa", "cc"])):
        world.agents.reports[ip] = {
            "verification": agent_api.VerificationReport(
                integrity="checksum", method="agreement", buckets=2, bucket_digests=digests
            )
        }
    world.refit(1, {"session": {"name": "grpo"}})

    done = run(world, "tiny-v1")

    assert done["phase"] == "Failed" and done["attempts"] == 1
    failed = condition(world.api.objects[("Refit", NS, "tiny-v1")], "Failed")
    assert failed["reason"] == refit_status.DIGEST_DISAGREEMENT
    assert "bucket 1" in failed["message"] and "shard 1, pod tiny-s1-p0 has cc" in failed["message"]
    assert done["verification"]["method"] == "agreement"
    assert done["verification"]["mismatch"] == {"shard": 1, "pod": "tiny-s1-p0", "bucket": 1, "firstTensor": ""}
    assert world.api.objects[("RefitSession", NS, "grpo")]["status"]["phase"] == "Broken"
    assert all(modes_of(body)["suspendMode"] == "drain" for body in sent(world)), "a session refit carries it too"


def test_shards_that_loaded_other_bytes_from_one_checkpoint_fail_the_refit_naming_the_minority() -> None:
    """A checkpoint refit with ``integrity: checksum``: every rank digests the parameters it loaded, and
    the pods at the same position of every shard must agree (here one pod per shard, three shards)."""
    world = World(refit={"integrity": "checksum"}, replicas=3)
    world.start()
    ips = world.pod_ips()
    for pod, digests in (("tiny-s0-p0", ["aa", "bb"]), ("tiny-s1-p0", ["aa", "bb"]), ("tiny-s2-p0", ["aa", "cc"])):
        world.agents.reports[ips[pod]] = {
            "source": "checkpoint",
            "verification": agent_api.VerificationReport(
                integrity="checksum", method="agreement", buckets=2, bucket_digests=digests
            ),
        }
    world.refit(1, {"checkpoint": {"path": "/ckpt/1"}})

    done = run(world, "tiny-v1")

    assert {body.get("integrity") for body in sent(world)} == {"checksum"}
    assert done["phase"] == "Failed", done
    failed = condition(world.api.objects[("Refit", NS, "tiny-v1")], "Failed")
    assert failed["reason"] == refit_status.DIGEST_DISAGREEMENT
    assert "shard 2, pod tiny-s2-p0: bucket 1's digest cc differs from the 2 of 3 members" in failed["message"]
    assert done["verification"]["mismatch"] == {"shard": 2, "pod": "tiny-s2-p0", "bucket": 1, "firstTensor": ""}


def test_staging_required_that_the_engines_cannot_honour_fails_before_any_member_receives() -> None:
    world = World()
    world.start()
    world.refit(1, RENDEZVOUS)
    world.api.objects[("Refit", NS, "tiny-v1")]["spec"]["staging"] = "required"
    states_only = world.agents

    class OnlyStates(NoAgents):
        async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
            return await states_only.states(pod_ips, token)

    world.agents = cast(Any, OnlyStates())

    done = world.advance_refit("tiny-v1")["status"]

    assert done["phase"] == "Failed"
    failed = condition(world.api.objects[("Refit", NS, "tiny-v1")], "Failed")
    assert failed["reason"] == refit_status.STAGING_UNAVAILABLE
    assert failed["message"].startswith("staging required, but shard 0 (pod tiny-s0-p0) cannot stage")
    assert done["staging"]["effective"] == "inPlace"
    assert world.fleet()["status"].get("refit", {}).get("active") is None, "the fleet was never locked"


def test_keep_unavailable_stays_on_a_refit_that_a_member_refused_at_once() -> None:
    world = World(refit={"inFlight": "keep"})
    world.start()
    world.session()
    world.refit_info()
    world.joined()
    world.agents.refuse_refit[world.pod_ips()["tiny-s1-p0"]] = "HTTP 409: busy"
    world.refit(1, {"session": {"name": "grpo"}})

    done = world.advance_refit("tiny-v1")["status"]

    assert done["phase"] == "Failed" and "tiny-s1-p0 refused: HTTP 409: busy" in done["message"]
    kinds = {c["type"]: c["reason"] for c in done["conditions"]}
    assert kinds == {"Failed": "Failed", refit_status.KEEP_UNAVAILABLE: modes.BACKEND_CANNOT_KEEP}
    assert done["inFlight"]["effective"] == "drain"


def test_members_an_operator_never_told_before_it_died_are_told_again_and_the_refit_completes() -> None:
    """The status says the attempt runs, but its operator stopped before telling one member (its
    agent shows no such version): the next operator's poll tells that member again, with the
    published offset and the same modes, and the Refit succeeds."""
    world = World(refit={"inFlight": "keep"})
    world.start()
    for ip in world.pod_ips().values():
        world.agents.capabilities[ip] = KEEPS
    world.refit(1, {"checkpoint": {"path": "/ckpt/1"}})
    first = world.advance_refit("tiny-v1")["status"]
    assert first["phase"] == "Running" and len(world.agents.starts) == 2
    lost_ip, lost_body = world.agents.starts[-1]
    del world.agents.versions[lost_ip]  # as if that call had never been made

    done = run(world, "tiny-v1")

    assert done["phase"] == "Succeeded", done
    again = [(ip, body) for ip, body in world.agents.starts[2:]]
    assert [ip for ip, _ in again] == [lost_ip]
    assert agent_client._json(again[0][1]) == agent_client._json(lost_body)
