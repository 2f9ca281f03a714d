"""In-flight refits end to end (docs/proposals/0003-in-flight-refits.md): a Refit with
``inFlight: keep`` lands while eight long greedy streams are mid-generation on the two-shard tiny
CPU fleet, against the real control plane, the operator and engine pods run by the local runner.

No stream fails; every streamed chunk's tokens carry the version that computed them and each
stream's final spans say exactly where its switch fell. Under ``kvCacheMode: recompute`` the tokens
after the switch are what a fresh model at the new version generates greedily from the prompt plus
the tokens before it, and the tokens before it are the old version's own greedy output; a Refit at the fleet's defaults
(``inFlight: keep`` under ``persist``, ``staging: auto``: no refit settings anywhere) keeps and stages,
its pause the switch only. A keep Refit that fails (its checkpoint does not exist) leaves every stream
running on the old version.
"""

from __future__ import annotations

import pytest

from helpers import inflight_streams as inflight
from helpers import refit_e2e
from megafleet.objects import Object
from megafleet_dev import kube


def create_fleet(kube_admin: kube.Kube, namespace: str, **refit: str) -> Object:
    kube_admin.create(refit_e2e.fleets(namespace), inflight.long_fleet(**refit))
    ready = kube_admin.wait(f"{refit_e2e.fleets(namespace)}/tiny", refit_e2e.ready, timeout=refit_e2e.WAIT)
    assert ready is not None and ready["status"]["weightVersion"] == 0
    return ready


@pytest.fixture
def fleet(operator: object, kube_admin: kube.Kube, namespace: str) -> Object:
    """The fleet whose refits write in place (``spec.refit.staging: off``: no staging copy)."""
    return create_fleet(kube_admin, namespace, staging="off")


@pytest.fixture
def staged_fleet(operator: object, kube_admin: kube.Kube, namespace: str) -> Object:
    """The fleet at its defaults: its engines hold a staging copy (``spec.refit.staging: auto``, the
    default, allocated at start when the memory allows: the local runner's pods have no memory limit)."""
    return create_fleet(kube_admin, namespace)


def ended(kube_admin: kube.Kube, path: str) -> Object:
    done = kube_admin.wait(path, refit_e2e.refit_ended, timeout=refit_e2e.WAIT, what="the keep refit to end")
    assert done is not None
    return done


def test_a_keep_refit_recomputes_mid_generation_and_every_stream_continues_on_the_new_weights(
    fleet: Object, kube_admin: kube.Kube, namespace: str
) -> None:
    running = inflight.start_streams(inflight.frontends(kube_admin, namespace, fleet))

    path = inflight.create_refit(
        kube_admin, namespace, 1, inflight.NEW_SOURCE, inFlight="keep", kvCacheMode="recompute"
    )
    result = ended(kube_admin, path)
    loads = inflight.finish(running)

    status = result["status"]
    assert status["phase"] == "Succeeded", status
    assert status["inFlight"]["effective"] == "keep" and status["inFlight"]["kvCacheMode"] == "recompute"
    assert status["inFlight"]["kept"] == inflight.STREAMS and status["inFlight"]["aborted"] == 0
    assert status["inFlight"]["recomputedTokens"] > 0
    assert status["staging"]["effective"] == "inPlace"
    assert (kube.condition(result, "KeepUnavailable") or {}).get("status", "False") == "False"
    assert inflight.check_kept(loads, "recompute") == inflight.STREAMS  # every stream spanned it


def test_a_refit_at_the_defaults_keeps_under_persist_stages_and_pauses_only_for_the_switch(
    staged_fleet: Object, kube_admin: kube.Kube, namespace: str
) -> None:
    """Neither the fleet nor the Refit names an in-flight mode, a KV mode or staging."""
    running = inflight.start_streams(inflight.frontends(kube_admin, namespace, staged_fleet))

    path = inflight.create_refit(kube_admin, namespace, 1, inflight.NEW_SOURCE)
    result = ended(kube_admin, path)
    loads = inflight.finish(running)

    status = result["status"]
    assert status["phase"] == "Succeeded", status
    assert status["inFlight"]["requested"] == status["inFlight"]["effective"] == "keep"
    assert status["inFlight"]["kvCacheMode"] == "persist" and status["inFlight"]["kept"] == inflight.STREAMS
    assert status["staging"]["requested"] == "auto"
    assert status["staging"]["effective"] == "staged" and status["staging"]["bytes"] > 0
    assert status["pause"]["shards"] and status["pause"]["stallMaxMilliseconds"] >= 0
    assert inflight.check_kept(loads, "persist") == inflight.STREAMS


def test_a_keep_refit_that_fails_leaves_every_stream_on_the_old_version(
    staged_fleet: Object, kube_admin: kube.Kube, namespace: str
) -> None:
    """The checkpoint does not exist: the attempt fails before any weight is written (staged or not),
    and every kept sequence goes on under the old version, none failing."""
    running = inflight.start_streams(inflight.frontends(kube_admin, namespace, staged_fleet))

    path = inflight.create_refit(kube_admin, namespace, 1, "/nonexistent/megafleet-checkpoint", inFlight="keep")
    result = ended(kube_admin, path)
    loads = inflight.finish(running)

    assert result["status"]["phase"] == "Failed", result["status"]
    assert "does not exist" in str(result["status"]), result["status"]
    for stream in inflight.streams_of(loads):
        assert stream.error is None, stream.error
        assert stream.finish_reason == "length" and stream.versions == [0] * inflight.MAX_TOKENS
        assert stream.plain_spans() == [{"start": 0, "version": 0}]
        assert stream.tokens == inflight.continuation(inflight.OLD_SOURCE, stream.prompt, inflight.MAX_TOKENS)
    after = kube_admin.get(f"{refit_e2e.fleets(namespace)}/tiny")
    assert after is not None and after["status"]["weightVersion"] == 0
