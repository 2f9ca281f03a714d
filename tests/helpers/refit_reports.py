"""Shared test helper (it holds no tests): member pods' ``GET /v1/refit/status`` answers for the Refit
controller's pure functions (:mod:`megafleet.refits.member_reports`, :mod:`megafleet.refits.agreement`)."""

from __future__ import annotations

from typing import Any

from megafleet.refits import member_reports
from megafleet_protocol import agent_api


def report(phase: str = "succeeded", error: str | None = None, **fields: Any) -> agent_api.RefitStatusResponse:
    """A member's answer for version 2, ``succeeded`` unless told, with the report ``fields`` given
    (``in_flight``, ``staging``, ``pause``, ``verification``, ``source``, ...)."""
    answer: dict[str, Any] = {
        "phase": phase,
        "version": 2,
        "source": "checkpoint",
        "transport": None,
        "rank": 0,
        "world_size": 1,
        "phases": [],
        "duration_milliseconds": 5,
        "bytes_received": 0,
        "buckets": 0,
        "tensors_written": 0,
        "error": error,
        "timed_out": False,
        "dirty": False,
        "state": "ready",
        "weight_version": 2,
    }
    return agent_api.RefitStatusResponse(**{**answer, **fields})


def member(shard: int, pod: int = 0, **fields: Any) -> member_reports.MemberReport:
    """Pod ``pod`` of shard ``shard`` of fleet ``f`` (named ``f-s<shard>-p<pod>``) answering :func:`report`."""
    return member_reports.MemberReport(shard, f"f-s{shard}-p{pod}", report(**fields))


def nemo_member(shard: int, digests: list[str]) -> member_reports.MemberReport:
    """A member of NeMo's wire that received buckets with these digests (in transfer order)."""
    verification = agent_api.VerificationReport(
        integrity="checksum", method="agreement", buckets=len(digests), bucket_digests=digests
    )
    return member(shard, source="nemo", verification=verification)
