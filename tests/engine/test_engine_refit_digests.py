"""A checkpoint refit with ``integrity: checksum`` through the agent (``POST /v1/refit/checkpoint``) on the
tiny CPU engine: the rank digests the parameters it loaded (:mod:`megafleet_protocol.refit.parameter_digests`)
and reports them for the operator to compare across the shards that loaded the same checkpoint
(``verification.method: agreement``). In place, the digests are the loaded version's; staged under the
operator's commit, they are the staging copy's, reported while the engine still serves the old version
(the operator compares them before it commits); an engine that loaded other bytes reports other digests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import engine_harness as harness
from helpers import refit_harness
from megafleet_engine import refit_staging
from megafleet_engine.backends import transformers_backend
from megafleet_engine.models import tiny
from megafleet_protocol.refit import parameter_digests

pytestmark = pytest.mark.slow  # each test starts an engine and its servers

NEW = "tiny://llama?seed=1"
PROMPT = [40, 41, 42, 43, 44]
WAIT_SECONDS = 60.0


@pytest.fixture
def served(tmp_path: Path) -> Iterator[harness.Served]:
    model, tokenizer = tiny.build_tiny("tiny://llama")
    backend = transformers_backend.TransformersBackend(
        model, tokenizer, name=harness.MODEL, max_sequence_length=harness.MAX_SEQUENCE_LENGTH
    )
    backend.prepare_staging()
    with harness.serve(backend, harness.token_file(tmp_path)) as running:
        running.engine.staging = refit_staging.StagingPlan("auto", bytes=backend.staging_bytes())
        yield running


def checkpoint(served: harness.Served, version: int, path: str, **more: Any) -> None:
    body = {"version": version, "path": path, "timeoutSeconds": 30, "integrity": "checksum", **more}
    with served.agent() as agent:
        response = agent.post("/v1/refit/checkpoint", json=body)
    assert response.status_code == 202, response.text


def wait_phase(served: harness.Served, phase: str) -> dict[str, Any]:
    client = refit_harness.AgentClient(served.agent_url)
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        status = client.status()
        if status["phase"] == phase:
            return status
        assert status["phase"] != "failed", status
        assert time.monotonic() < deadline, f"the refit did not reach {phase}: {status}"
        time.sleep(refit_harness.REFIT_POLL_SECONDS)  # polling the agent's status with a deadline


def test_an_in_place_checkpoint_load_reports_the_digests_of_what_it_loaded(served: harness.Served) -> None:
    checkpoint(served, 1, NEW)
    done = wait_phase(served, "succeeded")

    expected = parameter_digests.reference(tiny.reference_weights(NEW))
    assert expected == parameter_digests.reference(served.backend.parameters())
    assert done["verification"] == {
        "integrity": "checksum",
        "method": "agreement",
        "buckets": len(expected),
        "mismatch": None,
        "bucketDigests": expected,
        "nonFinite": None,
    }


def test_a_staged_load_reports_the_staging_copys_digests_before_the_operators_commit(served: harness.Served) -> None:
    before = refit_harness.completion_ids(served.frontend_url, PROMPT, 6)
    live = {name: tensor.clone() for name, tensor in served.backend.parameters().items()}
    checkpoint(served, 1, NEW, staging="required", commit="operator")
    staged = wait_phase(served, "staged")

    assert staged["verification"]["bucketDigests"] == parameter_digests.reference(served.backend.staged_parameters())
    assert staged["verification"]["bucketDigests"] != parameter_digests.reference(live), (
        "the new version's, not the live one's"
    )
    assert refit_harness.completion_ids(served.frontend_url, PROMPT, 6) == before, "it serves the old version meanwhile"
    with served.agent() as agent:
        assert agent.post("/v1/refit/commit", json={"version": 1}).status_code == 200
    done = wait_phase(served, "succeeded")
    assert done["verification"]["bucketDigests"] == parameter_digests.reference(served.backend.parameters())
