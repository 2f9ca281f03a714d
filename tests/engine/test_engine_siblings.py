"""One refit status for a pod of several ranks (:func:`megafleet_engine.siblings.combine`)."""

from __future__ import annotations

from typing import Any

from megafleet_engine import siblings


def _status(phase: str, rank: int, **extra: Any) -> dict[str, Any]:
    return {
        "phase": phase,
        "version": 3,
        "rank": rank,
        "error": None,
        "phases": [{"name": "receive", "milliseconds": 10 * rank}],
        "durationMilliseconds": 100 * rank if phase in ("succeeded", "failed") else None,
        "bytesReceived": 1000,
        "buckets": 2,
        "tensorsWritten": 5,
        "dirty": False,
        "timedOut": False,
        "state": "ready",
        "weightVersion": 3,
        **extra,
    }


def test_the_pod_succeeds_only_when_every_rank_has() -> None:
    done = siblings.combine(_status("succeeded", 1), [_status("succeeded", 2), _status("succeeded", 3)])
    assert done["phase"] == "succeeded" and done["durationMilliseconds"] == 300
    assert (done["bytesReceived"], done["buckets"], done["tensorsWritten"]) == (3000, 6, 15)
    assert done["phases"] == [{"name": "receive", "milliseconds": 30}], "the slowest rank's timing"

    running = siblings.combine(_status("succeeded", 1), [_status("receiving", 2)])
    assert running["phase"] == "receiving" and running["durationMilliseconds"] is None


def test_any_failed_rank_fails_the_pod_with_its_error() -> None:
    combined = siblings.combine(
        _status("receiving", 1), [_status("failed", 2, error="boom", timedOut=True, dirty=True)]
    )
    assert combined["phase"] == "failed" and combined["error"] == "rank 2: boom"
    assert combined["timedOut"] and combined["dirty"]
    assert (combined["state"], combined["rank"]) == ("ready", 1), "what the pod serves is local rank 0's"


def test_a_rank_still_on_an_older_attempt_holds_the_pod_back() -> None:
    combined = siblings.combine(_status("succeeded", 1), [_status("succeeded", 2, version=2)])
    assert combined["phase"] == "suspending"


def test_the_rank_that_caught_a_corrupt_bucket_speaks_for_the_pods_verification() -> None:
    def verified(mismatch: dict[str, Any] | None = None) -> dict[str, Any]:
        report = {"integrity": "checksum", "method": "trainerDigest", "buckets": 7, "mismatch": mismatch}
        return report | {"bucketDigests": [], "nonFinite": None}

    caught = {"bucket": 2, "firstTensor": "model.layers.0.mlp.up_proj.weight"}
    combined = siblings.combine(
        _status("succeeded", 1, verification=verified()),
        [_status("failed", 2, verification=verified(caught)), _status("succeeded", 3, verification=verified())],
    )
    assert combined["verification"] == verified(caught) | {"buckets": 21}, "buckets summed like the counters"
    clean = siblings.combine(_status("succeeded", 1, verification=verified()), [_status("succeeded", 2)])
    assert clean["verification"] == verified(), "a rank without a report (an older engine) adds nothing"
    assert "verification" not in siblings.combine(_status("succeeded", 1), [_status("succeeded", 2)])


def test_ranks_that_digested_their_own_parameters_report_their_lists_in_rank_order() -> None:
    def digests(*found: str) -> dict[str, Any]:
        report = {"integrity": "checksum", "method": "agreement", "buckets": len(found), "mismatch": None}
        return report | {"bucketDigests": list(found), "nonFinite": None}

    own = _status("succeeded", 4, verification=digests("a0", "a1"))
    combined = siblings.combine(own, [_status("succeeded", 6, verification=digests("c0")),
                                      _status("succeeded", 5, verification=digests("b0", "b1"))])  # fmt: skip
    assert combined["verification"] == digests("a0", "a1", "b0", "b1", "c0"), "megatron-native, a checkpoint"
    same = siblings.combine(own, [_status("succeeded", 5, verification=digests("a0", "a1"))])
    assert same["verification"] == digests("a0", "a1") | {"buckets": 4}, "NeMo's wire: every rank the same bytes"


def test_sibling_ports_follow_the_agent_port() -> None:
    assert [siblings.sibling_port(8471, rank) for rank in range(3)] == [8471, 8472, 8473]


def test_sibling_agents_stay_on_the_pods_loopback() -> None:
    assert siblings.sibling_host("10.4.2.17") == "127.0.0.1", "a real pod: private to the pod"
    assert siblings.sibling_host("127.0.12.1") == "127.0.12.1", "the local runner: pods share one loopback"


def test_the_pods_membership_of_nemos_world_is_its_least_advanced_rank() -> None:
    joined = {"session": "s", "phase": "joined", "rank": 1, "generation": "nemo", "error": None}
    joining = dict(joined, rank=2, phase="joining")
    failed = dict(joined, rank=3, phase="failed", error="store timeout")

    assert siblings.combine_world([joined, dict(joined, rank=2)]) == joined
    assert siblings.combine_world([joined, joining])["phase"] == "joining"  # type: ignore[index]
    assert siblings.combine_world([joined, joining, failed]) == dict(
        joined, phase="failed", error="rank 3: store timeout"
    )
    assert siblings.combine_world([None, None]) is None
    missing = siblings.combine_world([joined, None])
    assert missing is not None and missing["phase"] == "failed" and "has not joined" in missing["error"]
