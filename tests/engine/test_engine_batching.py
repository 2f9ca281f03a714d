"""Many prompts in one request, ``n`` per prompt, the token-ids-only mode and per-step coalescing,
through the official ``openai`` client against the frontend in the engine's process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helpers import engine_harness as harness
from megafleet_engine.openai import protocol


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Served]:
    with harness.serve(harness.tiny_backend(), harness.token_file(tmp_path_factory.mktemp("batching"))) as running:
        yield running


def _ids(choice: object) -> list[int]:
    extra = getattr(choice, "model_extra", None) or {}
    return [int(token) for token in extra["token_ids"]]


def test_a_list_of_prompts_is_one_batch_with_n_choices_each(served: harness.Served) -> None:
    prompts: list[Any] = ["hello there", [5, 6, 7, 8]]  # text and token ids mixed (the frontend takes both)
    with served.openai_client() as client:
        singles = [
            client.completions.create(
                model=harness.MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
            )
            for prompt in prompts
        ]
        batches_before = served.engine.batches
        both = client.completions.create(
            model=harness.MODEL,
            prompt=prompts,
            max_tokens=6,
            temperature=0,
            n=2,
            extra_body={"return_token_ids": True},
        )
    assert [choice.index for choice in both.choices] == [0, 1, 2, 3]
    expected = [_ids(singles[0].choices[0])] * 2 + [_ids(singles[1].choices[0])] * 2
    assert [_ids(choice) for choice in both.choices] == expected
    assert [choice.text for choice in both.choices[::2]] == [single.choices[0].text for single in singles]
    # the four sequences reached the idle engine together: one backend batch of four, no admission
    assert served.engine.batches == batches_before + 1
    assert served.engine.batch_sizes[-1] == 4
    assert both.usage is not None and both.usage.completion_tokens == 24
    assert (both.model_extra or {})["weight_version"] == 0


def test_prompts_times_n_above_the_limit_is_a_400_with_the_openai_body(served: harness.Served) -> None:
    with served.http() as http:
        response = http.post(
            "/v1/completions", json={"model": harness.MODEL, "prompt": ["a", "b"], "n": protocol.MAX_N, "max_tokens": 1}
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "n" and error["type"] == "invalid_request_error"
    assert "256 sequences" in error["message"]


def test_token_ids_only_answers_ids_and_no_text(served: harness.Served) -> None:
    body = {"model": harness.MODEL, "prompt": [[9, 10, 11], [12, 13]], "max_tokens": 5, "temperature": 0}
    with served.http() as http:
        texts = http.post("/v1/completions", json={**body, "return_token_ids": True}).json()
        ids_only = http.post("/v1/completions", json={**body, "detokenize": False, "logprobs": 1}).json()
        streamed = http.post("/v1/completions", json={**body, "detokenize": False, "stream": True}).text
        refused = http.post("/v1/completions", json={**body, "detokenize": False, "stop": ["x"]})
    assert [choice["text"] for choice in ids_only["choices"]] == ["", ""]
    assert [choice["token_ids"] for choice in ids_only["choices"]] == [c["token_ids"] for c in texts["choices"]]
    assert ids_only["choices"][1]["prompt_token_ids"] == [12, 13]
    logprobs = ids_only["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{token}" for token in ids_only["choices"][0]["token_ids"]]
    assert len(logprobs["token_logprobs"]) == 5 and logprobs["text_offset"] == []
    assert '"text":""' in streamed and streamed.rstrip().endswith("data: [DONE]")
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.slow  # starts an engine, a server, Ray or a subprocess, or computes for a while
def test_a_stream_writes_one_piece_per_engine_step(served: harness.Served) -> None:
    """Two prompts x n=2 streamed: every engine step's deltas arrive in one network write, so the
    response has at most one piece per step (steps = max_tokens), never one per token."""
    body = {
        "model": harness.MODEL,
        "prompt": ["ab", "cd"],
        "n": 2,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,  # a chunk for every token, text or not
    }
    pieces: list[bytes] = []
    with (
        httpx.Client(base_url=served.frontend_url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        pieces.extend(response.iter_raw())
    text = b"".join(pieces).decode()
    events = [line for line in text.split("\n\n") if line.startswith("data: {")]
    assert len(events) == 4 * 8  # every token of every choice, each its own chunk
    assert len(pieces) <= 8 + 1  # ... written once per step (plus [DONE])
