"""NeMo's wire carries no digest, so its members' agreement is what verifies it: three engines in this
process (the tiny Llama on CPU) join one NeMo world as its inference ranks 1..3, an independent NeMo
trainer (:mod:`helpers.nemo_trainer`, rank 0, gloo) broadcasts a version in NeMo's packed buckets, and
the receiving side of one member is made to take a corrupt bucket: a test-only hook,
``NemoReceiver.corrupt_bucket``, flips the first byte of that bucket on that rank alone as it arrives
(the receiving side's counterpart of ``WeightSender(corrupt_bucket=k)`` on our wire; the test sets it
on the member's receiver as the join builds it). Every member reports its per-bucket ``mf64`` digests
(``verification.bucketDigests``) and the operator's own functions judge them:
:func:`megafleet.refits.agreement.agreement` names the member in the minority and the bucket.

* Staged, under the operator's commit (``staging: required``, ``commit: operator``): the operator
  compares the digests once every member staged, before it decides the commit
  (:func:`megafleet.refits.commit.commit_decision` would commit; the disagreement comes first), and
  fails the attempt by aborting every member, as ``attempts.fail`` does. Nothing switched: every
  engine serves the old version (the same greedy tokens, version 0), none is dirty or stale.
* In place (``commit: local``, what an engine without a staging copy does): the operator can only
  compare once every member reported ``succeeded``, and each member switched when its own receive
  completed. The disagreement still names the member and the bucket, but every engine already serves
  the new version and the corrupt member serves corrupt weights: only the staged path keeps a
  disagreeing refit from going live. (The trainer's commit, which decides on our wire, is not offered
  on NeMo's: the agent refuses ``commit: trainer`` there, because NeMo's trainer writes no commit.)
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from helpers import nemo_trainer
from helpers import refit_harness as harness
from megafleet.refits import agreement, commit, member_reports
from megafleet_protocol import agent_api
from megafleet_protocol.refit import digest
from megafleet_protocol.refit import nemo as nemo_protocol

pytestmark = pytest.mark.slow  # each test starts three engines and a process group

MEMBERS = 3
VICTIM = 1  # the member (shard) whose receiver takes the corrupt bucket
CORRUPT_BUCKET = 2
PROMPT = [40, 41, 42, 43, 44]
TOKENS = 8
WAIT_SECONDS = 60.0
SESSION = "grpo-agreement"


@pytest.fixture
def members(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[harness.InProcessEngine]]:
    token = harness.token_file(tmp_path)
    staging = bool(request.param)
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(harness.serve_in_process(token, staging=staging)) for _ in range(MEMBERS)]


@pytest.fixture
def corrupting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The victim's receiver, as its join builds it, flips the first byte of bucket ``CORRUPT_BUCKET``."""
    connect = nemo_protocol.NemoReceiver.connect

    def connect_and_corrupt(world: nemo_protocol.NemoWorld, **options: Any) -> nemo_protocol.NemoReceiver:
        receiver = connect(world, **options)
        if world.rank == 1 + VICTIM:
            receiver.corrupt_bucket = CORRUPT_BUCKET
        return receiver

    monkeypatch.setattr(nemo_protocol.NemoReceiver, "connect", staticmethod(connect_and_corrupt))


def post(member: harness.InProcessEngine, path: str, body: Mapping[str, Any]) -> httpx.Response:
    with member.agent.client() as agent:
        return agent.post(path, json=body)


def wait_for(member: harness.InProcessEngine, done: Any, what: str) -> dict[str, Any]:
    """Poll the member's refit status until ``done(status)`` (the operator's loop), with a deadline."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        status = member.agent.status()
        if done(status):
            return status
        assert time.monotonic() < deadline, f"the member did not reach {what}: {status}"
        time.sleep(harness.REFIT_POLL_SECONDS)  # polling an HTTP status with a deadline


def join_all(members: list[harness.InProcessEngine], port: int) -> None:
    for shard, member in enumerate(members):
        rendezvous = {
            "address": harness.TRAINER_ADDRESS,
            "port": port,
            "worldSize": 1 + MEMBERS,
            "rankOffset": 1 + shard,
        }
        body = {"session": SESSION, "rendezvous": rendezvous, "timeoutSeconds": 60}
        accepted = post(member, "/v1/refit/nemo/join", body)
        assert accepted.status_code == 202, accepted.text
    for member in members:
        wait_for(member, lambda status: (status["world"] or {}).get("phase") == "joined", "a joined world")


def reports_of(statuses: list[dict[str, Any]]) -> list[member_reports.MemberReport]:
    """The members' status answers as the operator reads them (one pod per shard)."""
    return [
        member_reports.MemberReport(shard, f"member-{shard}", agent_api.RefitStatusResponse.model_validate(status))
        for shard, status in enumerate(statuses)
    ]


def expected_digests(weights: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[str]:
    """Each bucket's ``mf64`` as the numpy reference computes it from the trainer's bytes."""
    specs = nemo_protocol.refit_info({name: (tensor.shape, tensor.dtype) for name, tensor in weights.items()})
    return [
        digest.hex_digest(
            digest.reference(
                b"".join(
                    weights[spec.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for spec in bucket
                ),
                index,
            )
        )
        for index, bucket in enumerate(nemo_protocol.plan_buckets(specs, bucket_bytes))
    ]


def check_disagreement(statuses: list[dict[str, Any]], weights: Mapping[str, torch.Tensor], bucket_bytes: int) -> str:
    """The members' digests: the honest ones equal the trainer's, the victim's differ in the corrupt
    bucket only, and the operator's agreement names the victim and that bucket; returns its message."""
    expected = expected_digests(weights, bucket_bytes)
    assert len(expected) > CORRUPT_BUCKET + 1, "the corrupt bucket must not be the last"
    for shard, status in enumerate(statuses):
        verification = status["verification"]
        assert (verification["integrity"], verification["method"]) == ("checksum", "agreement"), verification
        got = verification["bucketDigests"]
        changed = [index for index, (one, want) in enumerate(zip(got, expected, strict=True)) if one != want]
        assert changed == ([CORRUPT_BUCKET] if shard == VICTIM else []), (shard, changed)

    reports = reports_of(statuses)
    found = agreement.agreement(reports)
    assert found is not None, "a corrupt bucket on one member must disagree"
    assert (found.shard, found.pod, found.bucket, found.buckets) == (
        VICTIM,
        f"member-{VICTIM}",
        CORRUPT_BUCKET,
        len(expected),
    )
    victim = statuses[VICTIM]["verification"]["bucketDigests"][CORRUPT_BUCKET]
    assert found.message == (
        f"shard {VICTIM}, pod member-{VICTIM}: bucket {CORRUPT_BUCKET}'s digest {victim} differs from the 2 of 3 "
        f"members that agree on {expected[CORRUPT_BUCKET]}"
    )
    recorded = found.verification("checksum").model_dump(mode="json", by_alias=True, exclude_none=True)
    assert recorded["mismatch"] == {
        "shard": VICTIM,
        "pod": f"member-{VICTIM}",
        "bucket": CORRUPT_BUCKET,
        "firstTensor": "",
    }
    two = agreement.agreement(reports[:2])  # two members: no majority, the one that differs from the first is named
    assert (
        two is not None
        and (two.shard, two.bucket) == (VICTIM, CORRUPT_BUCKET)
        and "no digest is held by a majority" in two.message
    )
    assert agreement.agreement([reports[0], reports[2]]) is None, "the honest members agree"
    return found.message


def serves(member: harness.InProcessEngine, tokens: list[int], version: int) -> bool:
    return harness.completion_ids(member.frontend_url, PROMPT, TOKENS) == (tokens, str(version))


@pytest.mark.parametrize("members", [True], indirect=True, ids=["staged"])
@pytest.mark.usefixtures("corrupting")
def test_a_member_that_received_a_corrupt_bucket_is_named_before_the_commit_and_nothing_switches(
    members: list[harness.InProcessEngine],
) -> None:
    trainer = harness.Trainer()
    before, header = harness.completion_ids(members[0].frontend_url, PROMPT, TOKENS)
    assert header == "0" and before != trainer.greedy(PROMPT, TOKENS), "the trainer's weights must change the output"
    original = [{name: tensor.clone() for name, tensor in member.backend.parameters().items()} for member in members]
    weights = trainer.weights()
    info = [{"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype)} for name, tensor in weights.items()]
    bucket_bytes = sum(tensor.numel() * tensor.element_size() for tensor in weights.values()) // 6
    nemo = nemo_trainer.AgentTrainer({}, bucket_bytes, members=MEMBERS)
    try:
        join_all(members, nemo.port)
        nemo.send(weights)
        body = {
            "version": 5, "session": SESSION, "timeoutSeconds": 60, "refitInfo": info, "bucketBytes": bucket_bytes,
            "integrity": "checksum", "staging": "required", "commit": "operator",
        }  # fmt: skip
        for member in members:
            accepted = post(member, "/v1/refit/nemo", body)
            assert accepted.status_code == 202, accepted.text
        staged = [wait_for(member, lambda status: status["phase"] == "staged", "staged") for member in members]
        assert all(serves(member, before, 0) for member in members), "staged members serve the old version"

        reports = reports_of(staged)
        start = {"commit": {"mode": "operator"}, "startTime": datetime.datetime.now(datetime.UTC).isoformat()}
        decision = commit.commit_decision(
            start, reports, datetime.datetime.now(datetime.UTC), pods=MEMBERS, wait_seconds=90
        )
        assert decision == commit.Commit(decided=False), "every member staged: only the digests stand in the way"
        message = check_disagreement(staged, weights, bucket_bytes)
        for member in members:  # the operator's attempts.fail: every member is aborted, nobody committed
            post(member, "/v1/refit/abort", {"reason": f"another member failed: {message}"})
        ended = [wait_for(member, lambda status: status["phase"] == "failed", "failed") for member in members]
    finally:
        nemo.finish()

    for member, status, weights_before in zip(members, ended, original, strict=True):
        assert (status["state"], status["weightVersion"], status["dirty"]) == ("ready", 0, False), status
        assert status["commit"]["committed"] is False and f"bucket {CORRUPT_BUCKET}" in status["error"], status
        for name, tensor in member.backend.parameters().items():
            assert torch.equal(tensor, weights_before[name]), f"{name} changed although nothing switched"
        assert serves(member, before, 0), "every engine serves the old version"


@pytest.mark.parametrize("members", [False], indirect=True, ids=["in-place"])
@pytest.mark.usefixtures("corrupting")
def test_in_place_every_member_has_switched_before_the_digests_can_be_compared(
    members: list[harness.InProcessEngine],
) -> None:
    trainer = harness.Trainer()
    weights = trainer.weights()
    info = [{"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype)} for name, tensor in weights.items()]
    bucket_bytes = sum(tensor.numel() * tensor.element_size() for tensor in weights.values()) // 6
    nemo = nemo_trainer.AgentTrainer({}, bucket_bytes, members=MEMBERS)
    try:
        join_all(members, nemo.port)
        nemo.send(weights)
        body = {
            "version": 5, "session": SESSION, "timeoutSeconds": 60, "refitInfo": info, "bucketBytes": bucket_bytes,
            "integrity": "checksum", "commit": "operator",
        }  # fmt: skip
        for member in members:
            accepted = post(member, "/v1/refit/nemo", body)
            assert accepted.status_code == 202, accepted.text
        done = [member.agent.wait_finished(WAIT_SECONDS) for member in members]
    finally:
        nemo.finish()

    assert [status["phase"] for status in done] == ["succeeded"] * MEMBERS, done
    for status in done:
        assert status["commit"]["effective"] == "local", "in place, a member cannot wait for the operator's commit"
    check_disagreement(done, weights, bucket_bytes)
    expected = trainer.greedy(PROMPT, TOKENS)
    for shard, member in enumerate(members):
        assert member.engine.weight_version == 5, "every member switched when its own receive completed"
        if shard != VICTIM:
            assert serves(member, expected, 5)
    corrupt = [
        name for name, tensor in members[VICTIM].backend.parameters().items() if not torch.equal(tensor, weights[name])
    ]
    assert len(corrupt) == 1, "the victim went live with the corrupt bucket's first tensor"
