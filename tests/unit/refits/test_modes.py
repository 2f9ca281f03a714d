"""The modes a Refit runs with (:mod:`megafleet.refits.modes`): the Refit's overrides over the fleet's
settings, resolved against what the member engines can do, never downgraded silently; and what the
members' requests and the Refit's status carry of them."""

from __future__ import annotations

from typing import Any

import pytest

from megafleet import agent_client
from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet.refits import modes
from megafleet_protocol import agent_api

KEEPS_ALL = agent_api.Capabilities(keep_modes=["persist", "offload", "recompute"], staging_bytes=1 << 30)
TRANSFORMERS = agent_api.Capabilities(keep_modes=["persist", "recompute"], staging_bytes=1 << 20)
NOTHING = agent_api.Capabilities()
NO_ROOM = agent_api.Capabilities(keep_modes=["persist"], staging_reason="needs 19.1 GiB, free 9.8 GiB")
MEGATRON = agent_api.Capabilities(keep_modes=["persist", "recompute"], staging_bytes=1 << 30)
"""A megatron engine as the operator starts it: no static KV pointers, so it does not keep under offload."""


def fleet(engine: dict[str, Any] | None = None, **refit: Any) -> v1alpha1.MegatronGenerationSpec:
    return v1alpha1.MegatronGenerationSpec.model_validate(
        {"model": {"source": "/m"}, "resources": {"gpusPerNode": 1}, "engine": engine or {}, "refit": refit}
    )


def refit(**overrides: Any) -> v1alpha1.RefitObjectSpec:
    return v1alpha1.RefitObjectSpec.model_validate(
        {"fleetRef": {"name": "f"}, "version": 2, "source": {"checkpoint": {"path": "/c"}}, **overrides}
    )


def members(*capabilities: agent_api.Capabilities) -> list[modes.MemberCapabilities]:
    return [modes.MemberCapabilities(shard, f"f-s{shard}-p0", found) for shard, found in enumerate(capabilities)]


def resolved(found: modes.Modes) -> tuple[str, str, str, str, str | None]:
    """(requested, in flight sent, kv sent, staging sent, KeepUnavailable's reason)."""
    reason = found.keep_unavailable.reason if found.keep_unavailable is not None else None
    return found.requested, found.in_flight, found.kv_cache_mode, found.staging, reason


@pytest.mark.parametrize(
    ("fleet_spec", "refit_spec", "capabilities", "expected"),
    [
        pytest.param(
            fleet(), refit(), [KEEPS_ALL], ("keep", "keep", "persist", "auto", None), id="defaults-keep-and-stage"
        ),
        pytest.param(
            fleet(),
            refit(),
            [NOTHING],
            ("keep", "drain", "persist", "off", modes.BACKEND_CANNOT_KEEP),
            id="defaults-on-an-engine-that-neither-keeps-nor-stages",
        ),
        pytest.param(
            fleet(inFlight="drain", staging="off"),
            refit(),
            [KEEPS_ALL],
            ("drain", "drain", "persist", "off", None),
            id="drain-and-off-named",
        ),
        pytest.param(
            fleet(inFlight="keep", staging="off"),
            refit(),
            [KEEPS_ALL, KEEPS_ALL],
            ("keep", "keep", "persist", "off", None),
            id="keep",
        ),
        pytest.param(
            fleet(inFlight="drain", staging="off"),
            refit(inFlight="keep", kvCacheMode="recompute", staging="auto"),
            [TRANSFORMERS],
            ("keep", "keep", "recompute", "auto", None),
            id="refit-overrides-fleet",
        ),
        pytest.param(
            fleet(inFlight="keep"),
            refit(inFlight="abort", staging="off"),
            [KEEPS_ALL],
            ("abort", "abort", "persist", "off", None),
            id="refit-abort-over-fleet-keep",
        ),
        pytest.param(
            fleet(inFlight="keep"),
            refit(),
            [KEEPS_ALL, NOTHING],
            ("keep", "drain", "persist", "off", modes.BACKEND_CANNOT_KEEP),
            id="one-member-cannot-keep-all-drain",
        ),
        pytest.param(
            fleet(),
            refit(inFlight="keep", kvCacheMode="offload"),
            [TRANSFORMERS],
            ("keep", "drain", "persist", "auto", modes.KV_CACHE_MODE_NOT_KEPT),
            id="kv-mode-not-kept-drains-with-the-fleets-kv",
        ),
        pytest.param(
            fleet(engine={"backend": "megatron", "kvCacheMode": "offload"}),
            refit(),
            [MEGATRON],
            ("keep", "drain", "offload", "auto", modes.KV_CACHE_MODE_NOT_KEPT),
            id="default-keep-under-offload-drains-and-says-so",
        ),
        pytest.param(
            fleet(inFlight="drain", staging="auto"),
            refit(),
            [KEEPS_ALL],
            ("drain", "drain", "persist", "auto", None),
            id="auto-stages",
        ),
        pytest.param(
            fleet(),
            refit(),
            [KEEPS_ALL, NO_ROOM],
            ("keep", "keep", "persist", "off", None),
            id="auto-without-room-in-place",
        ),
        pytest.param(
            fleet(staging="auto"),
            refit(staging="off"),
            [KEEPS_ALL],
            ("keep", "keep", "persist", "off", None),
            id="refit-turns-staging-off",
        ),
    ],
)
def test_modes_resolve_against_the_members_capabilities(
    fleet_spec: v1alpha1.MegatronGenerationSpec,
    refit_spec: v1alpha1.RefitObjectSpec,
    capabilities: list[agent_api.Capabilities],
    expected: tuple[str, str, str, str, str | None],
) -> None:
    assert resolved(modes.resolve(fleet_spec, refit_spec, members(*capabilities))) == expected


def test_keep_unavailable_names_the_member_and_what_it_keeps() -> None:
    cannot = modes.resolve(fleet(inFlight="keep"), refit(), members(KEEPS_ALL, NOTHING, NOTHING)).keep_unavailable
    kv = modes.resolve(fleet(), refit(inFlight="keep", kvCacheMode="offload"), members(TRANSFORMERS)).keep_unavailable

    assert cannot is not None and cannot.status is True
    assert cannot.message == (
        "shard 1 (pod f-s1-p0) cannot keep sequences across a refit (and 1 more pods); every member drained "
        f"({modes.DRAIN_WITHOUT_CONDITION})"
    )
    assert kv is not None
    assert kv.message == "shard 0 (pod f-s0-p0) keeps with persist or recompute, not offload; every member drained"


def test_keep_unavailable_under_the_fleets_default_says_how_to_drain_without_it() -> None:
    """keep is the default: a fleet whose engines cannot keep under its KV mode drains at every Refit, and
    the condition tells how to ask for drain instead (a Refit's own keep gets no such hint)."""
    megatron_offload = fleet(engine={"backend": "megatron", "kvCacheMode": "offload"})
    default = modes.resolve(megatron_offload, refit(), members(MEGATRON)).keep_unavailable
    asked = modes.resolve(megatron_offload, refit(inFlight="keep"), members(MEGATRON)).keep_unavailable
    named = modes.resolve(fleet(inFlight="drain"), refit(), members(NOTHING)).keep_unavailable

    assert default is not None and default.reason == modes.KV_CACHE_MODE_NOT_KEPT
    assert default.message == (
        "shard 0 (pod f-s0-p0) keeps with persist or recompute, not offload; every member drained "
        "(the fleet's refit.inFlight is keep; set it to drain to drain without this condition)"
    )
    assert asked is not None and modes.DRAIN_WITHOUT_CONDITION not in asked.message
    assert named is None


def test_staging_auto_without_a_copy_says_why_and_required_fails_before_it_starts() -> None:
    auto = modes.resolve(fleet(staging="auto"), refit(), members(KEEPS_ALL, NO_ROOM))
    required = modes.resolve(fleet(), refit(staging="required"), members(NOTHING))
    native = modes.resolve(fleet(staging="required"), refit(), members(KEEPS_ALL), native_swap=True)

    assert (auto.staging, auto.staging_unavailable) == ("off", None)
    assert auto.staging_reason == "shard 1 (pod f-s1-p0) cannot stage: needs 19.1 GiB, free 9.8 GiB"
    assert (required.staging, required.staging_reason) == ("off", None)
    assert required.staging_unavailable is not None and "allocated no staging copy" in required.staging_unavailable
    assert native.staging_unavailable == modes.NATIVE_SWAP_WRITES_LIVE


@pytest.mark.parametrize(
    ("found", "expected"),
    [
        pytest.param(
            modes.resolve(fleet(), refit(), members(NOTHING)),
            {"suspendMode": "drain", "kvCacheMode": "persist"},
            id="defaults-on-an-engine-that-neither-keeps-nor-stages",
        ),
        pytest.param(
            modes.resolve(
                fleet(inFlight="keep", staging="auto", integrity="checksum"),
                refit(source={"rendezvous": {"address": "10.0.0.1", "port": 29600}}),
                members(KEEPS_ALL),
            ),
            {"suspendMode": "keep", "kvCacheMode": "persist", "staging": "auto", "integrity": "checksum"},
            id="everything-on",
        ),
        pytest.param(
            modes.resolve(fleet(inFlight="keep", staging="auto", integrity="checksum"), refit(), members(KEEPS_ALL)),
            {"suspendMode": "keep", "kvCacheMode": "persist", "staging": "auto", "integrity": "checksum"},
            id="a-checkpoint-load-digests-what-it-loaded",
        ),
    ],
)
def test_every_request_carries_the_modes(found: modes.Modes, expected: Object) -> None:
    body = agent_api.CheckpointRefitRequest(version=2, path="/c", **modes.request_fields(found))
    sent = agent_client._json(body)  # what the agent client puts on the wire
    assert {key: sent[key] for key in ("suspendMode", "kvCacheMode", "staging", "integrity") if key in sent} == expected


@pytest.mark.parametrize(
    ("found", "expected"),
    [
        pytest.param(
            modes.resolve(fleet(inFlight="keep", staging="off"), refit(), members(NOTHING)),
            {
                "inFlight": {
                    "requested": "keep",
                    "effective": "drain",
                    "kvCacheMode": "persist",
                    "reason": "shard 0 (pod f-s0-p0) cannot keep sequences across a refit; every member drained "
                    f"({modes.DRAIN_WITHOUT_CONDITION})",
                    "kept": 0,
                    "drained": 0,
                    "aborted": 0,
                    "abortedTokens": 0,
                    "recomputedTokens": 0,
                },
                "staging": {"requested": "off", "effective": "inPlace", "bytes": 0},
            },
            id="drained-in-place",
        ),
        pytest.param(
            modes.resolve(fleet(inFlight="drain", staging="auto"), refit(), members(KEEPS_ALL)),
            {
                "inFlight": {
                    "requested": "drain",
                    "effective": "drain",
                    "kvCacheMode": "persist",
                    "kept": 0,
                    "drained": 0,
                    "aborted": 0,
                    "abortedTokens": 0,
                    "recomputedTokens": 0,
                },
                "staging": None,
            },
            id="staging-known-from-the-reports-only",
        ),
    ],
)
def test_an_attempt_records_its_modes_as_it_starts(found: modes.Modes, expected: Object) -> None:
    assert modes.started_status(found) == expected
