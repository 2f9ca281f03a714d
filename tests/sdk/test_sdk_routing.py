"""Pure parts of the RL-job SDK: which shards take traffic, least-outstanding choice, NeMo RL's
output layout, and that the fleet client imports without torch, kopf or ray."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megafleet.api import v1alpha1
from megafleet.sdk import errors, generation, nemo, routing


def status(**fields: object) -> v1alpha1.MegatronGenerationStatus:
    return v1alpha1.MegatronGenerationStatus.model_validate(fields)


FLEET = status(
    endpoints=[
        {
            "shard": i,
            "url": f"http://10.96.0.{10 + i}:8000/v1",
            "dnsURL": f"http://f-s{i}.ns.svc:8000/v1",
            "service": f"f-s{i}",
        }
        for i in range(5)
    ],
    shards=[
        {"index": 0, "phase": "Ready", "pods": ["f-s0-p0"], "weightVersion": 3},
        {"index": 1, "phase": "Stale", "pods": ["f-s1-p0"], "weightVersion": 2},
        {"index": 2, "phase": "Ready", "pods": ["f-s2-p0"], "weightVersion": 3},
        {"index": 3, "phase": "Starting", "pods": ["f-s3-p0"]},
        {"index": 4, "phase": "Ready", "pods": ["f-s4-p0"], "weightVersion": 2},  # not fenced yet: still behind
    ],
    refit={"currentVersion": 3},
)


def test_only_ready_shards_at_the_current_version_are_routable() -> None:
    assert routing.routable(FLEET) == {0: 3, 2: 3}
    before_any_refit = status(
        shards=[{"index": 0, "phase": "Ready", "weightVersion": 0}, {"index": 1, "phase": "Loading"}]
    )
    assert routing.routable(before_any_refit) == {0: 0}


def test_the_members_of_a_running_refit_keep_their_traffic() -> None:
    # Observed mid-refit: shard 0 suspended (its engine holds requests for the new version), shard 1
    # already resumed at it, shard 2 not a member, shard 3 a member that fails.
    during = status(
        refit={
            "active": "f-v4",
            "currentVersion": 3,
            "membership": {
                "worldSize": 4,
                "trainerWorldSize": 1,
                "rankOffsets": [{"shard": s, "offset": 1 + s} for s in (0, 1, 3)],
            },
        },
        shards=[
            {"index": 0, "phase": "Refitting", "weightVersion": 3},
            {"index": 1, "phase": "Ready", "weightVersion": 4},
            {"index": 2, "phase": "Ready", "weightVersion": 3},
            {"index": 3, "phase": "Failed", "weightVersion": 3},
        ],
    )
    assert routing.routable(during) == {0: None, 1: None, 2: 3}
    finished = during.model_copy(update={"refit": during.refit.model_copy(update={"active": None})})  # type: ignore[union-attr]
    assert routing.routable(finished) == {2: 3}  # the members come back through the status that ends it


def test_frontend_urls_by_addressing() -> None:
    assert routing.endpoint_urls(FLEET, "service")[2] == "http://10.96.0.12:8000/v1"
    assert routing.endpoint_urls(FLEET, "dns")[2] == "http://f-s2.ns.svc:8000/v1"
    pods = routing.pod_urls(FLEET, {"f-s0-p0": "127.128.0.5", "f-s2-p0": "fd00::7"}, 8000)
    assert pods == {0: "http://127.128.0.5:8000/v1", 2: "http://[fd00::7]:8000/v1"}
    chosen = routing.select(routing.endpoint_urls(FLEET, "service"), routing.routable(FLEET))
    assert [(f.shard, f.weight_version) for f in chosen] == [(0, 3), (2, 3)]
    with pytest.raises(ValueError, match="pod addressing"):
        routing.endpoint_urls(FLEET, "pod")


def test_router_spreads_by_least_outstanding_and_rotates_ties() -> None:
    router = routing.Router([routing.Frontend(i, f"http://f{i}/v1", 0) for i in range(3)])
    leases = [router.acquire() for _ in range(9)]  # nothing finishes: exactly even
    assert sorted(router.sent.values()) == [3, 3, 3]
    for frontend in leases[:3]:
        router.release(frontend)
    busy_less = {frontend.url for frontend in leases[:3]}
    assert router.acquire().url in busy_less  # a frontend that finished work is preferred
    assert router.acquire(exclude=[f"http://f{i}/v1" for i in (0, 1)]).url == "http://f2/v1"
    with pytest.raises(errors.NoFrontend, match="besides"):
        router.acquire(exclude=[f"http://f{i}/v1" for i in range(3)])
    with pytest.raises(errors.NoFrontend):
        routing.Router().acquire()


def test_nemo_outputs_follow_nemo_rls_layout() -> None:
    input_ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    input_lengths = torch.tensor([3, 2])
    answers = [
        answer([11, 12], [-0.5, -0.25], "length", 4),
        answer([13, 14, 15], [-1.0, -2.0, -3.0], "stop", 4),
    ]
    out = nemo.pack_outputs(input_ids, input_lengths, answers, pad_token_id=0)
    assert out["output_ids"].tolist() == [[5, 6, 7, 11, 12, 0, 0], [8, 9, 13, 14, 15, 0, 0]]
    assert out["output_ids"].dtype == input_ids.dtype
    assert out["logprobs"].tolist() == [[0, 0, 0, -0.5, -0.25, 0, 0], [0, 0, -1.0, -2.0, -3.0, 0, 0]]
    assert out["logprobs"].dtype == torch.float32
    assert out["generation_lengths"].tolist() == [2, 3]
    assert out["unpadded_sequence_lengths"].tolist() == [5, 5]
    assert out["truncated"].tolist() == [True, False]
    assert out["weight_versions"].tolist() == [4, 4]
    assert out["last_weight_versions"].tolist() == [4, 4]
    assert out["token_weight_versions"].tolist() == [[-1, -1, -1, 4, 4, -1, -1], [-1, -1, 4, 4, 4, -1, -1]]


def answer(tokens: list[int], logprobs: list[float], finish: str, version: int) -> generation.Answer:
    return generation.Answer("", tokens, logprobs, None, finish, version, "http://f0/v1", 0)


@pytest.mark.slow  # starts engines, a process group or a subprocess
def test_the_fleet_client_imports_without_torch_kopf_or_ray() -> None:
    code = (
        "import sys; sys.modules['kopf'] = None; sys.modules['ray'] = None; "
        "import megafleet.sdk, megafleet.sdk.fleet; from megafleet.sdk import Fleet, Router; "
        "assert 'torch' not in sys.modules, 'torch was imported'; print(Fleet.__name__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "Fleet", result.stderr
    nemo_code = "import sys; sys.modules['ray'] = None; sys.modules['kopf'] = None; import megafleet.sdk.nemo"
    assert subprocess.run([sys.executable, "-c", nemo_code], timeout=120, check=False).returncode == 0
