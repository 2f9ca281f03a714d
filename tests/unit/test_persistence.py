"""Kopf's bookkeeping on our objects (megafleet.persistence): bounded, tolerant, no finalizers."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import kopf

from megafleet import handlers, names, persistence

KEY = f"{names.PREFIX}/last-handled-configuration"


def fleet(spec: dict[str, object], annotations: dict[str, str] | None = None) -> kopf.Body:
    metadata: Any = {"name": "big", "namespace": "rl", "uid": "u1", "annotations": annotations or {}}
    return kopf.Body(
        {"apiVersion": "megafleet.dev/v1alpha1", "kind": "MegatronGeneration", "metadata": metadata, "spec": spec}
    )


def stored(storage: persistence.DigestDiffBase, body: kopf.Body) -> str:
    patch = kopf.Patch()
    storage.store(body=body, patch=patch, essence=storage.build(body=body))
    return str(patch["metadata"]["annotations"][KEY])


def test_a_spec_near_the_object_size_limit_keeps_a_small_annotation() -> None:
    """Kopf stored the whole spec: past 256 KiB the fleet could not be updated or deleted
    (docs/incidents.md#kopf-last-handled-size)."""
    storage = persistence.DigestDiffBase(prefix=names.PREFIX, key="last-handled-configuration")
    big = {
        "model": {"source": "/m"},
        "engine": {"args": ["x" * 4000] * 64, "env": [{"name": "A", "value": "y" * 32000}] * 6},
    }

    annotation = stored(storage, fleet(big))

    assert len(annotation) < 1024
    assert storage.fetch(body=fleet(big, {KEY: annotation})) == storage.build(body=fleet(big))


def test_a_spec_change_still_shows_as_a_change_of_the_spec() -> None:
    storage = persistence.DigestDiffBase(prefix=names.PREFIX, key="last-handled-configuration")
    before = storage.build(body=fleet({"replicas": 1}))
    after = storage.build(body=fleet({"replicas": 2}))

    assert before != after and before["spec"] != after["spec"]


class NotToCopy:
    def __deepcopy__(self, memo: object) -> NotToCopy:
        raise AssertionError("the status was deep-copied")


def test_the_essence_is_kopfs_without_copying_the_status_or_managed_fields() -> None:
    """Kopf deep-copied every fleet event's whole body (status and managedFields too) to drop them
    again: ~10 % of the operator's CPU with 125 fleets starting. The digests are Kopf's own
    essence's, so an upgraded operator sees no change in a fleet."""
    storage = persistence.DigestDiffBase(prefix=names.PREFIX, key="last-handled-configuration")
    plain = fleet({"replicas": 2}, {"team": "rl"})
    raw: dict[str, Any] = dict(plain)
    heavy = kopf.Body(
        cast(
            kopf.RawBody,
            {
                **raw,
                "metadata": {**raw["metadata"], "managedFields": [NotToCopy()], "labels": {"a": "b"}},
                "status": {"shards": [NotToCopy()]},
            },
        )
    )
    labelled = kopf.Body(cast(kopf.RawBody, {**raw, "metadata": {**raw["metadata"], "labels": {"a": "b"}}}))

    assert storage.build(body=heavy) == storage.build(body=labelled)
    assert storage.build(body=heavy) != storage.build(body=plain)  # labels are in the essence
    assert stored(storage, heavy) == stored(storage, labelled)
    unslimmed = kopf.AnnotationsDiffBaseStorage(prefix=names.PREFIX, key="last-handled-configuration")
    expected = {key: {"sha256": persistence._digest(value)} for key, value in unslimmed.build(body=labelled).items()}
    assert storage.build(body=heavy) == expected


def test_a_malformed_record_reads_as_none_so_the_object_is_handled_again() -> None:
    """A malformed annotation raised JSONDecodeError at every event: the fleet was never reconciled again."""
    diffbase = persistence.DigestDiffBase(prefix=names.PREFIX, key="last-handled-configuration")
    progress = persistence.TolerantProgress(prefix=names.PREFIX)

    # The last one nests past Python's recursion limit (an annotation may hold 256 KiB of "[").
    for malformed in ("{not json", "[1, 2]", "7", "[" * 100_000):
        body = fleet({}, {KEY: malformed, f"{names.PREFIX}/observe": malformed})
        assert diffbase.fetch(body=body) is None
        assert progress.fetch(key=kopf.HandlerId("observe"), body=body) is None


def test_no_handler_puts_a_finalizer_on_fleets_or_refits_only_sessions_have_one() -> None:
    """Kopf gave every object with a timer a finalizer: without an operator, deletion hung
    (docs/incidents.md#kopf-timer-finalizers).
    The end-to-end proof is tests/e2e/test_hostile_specs.py."""
    registry = kopf.get_default_registry()
    spawning = registry._spawning.get_all_handlers()
    changing = registry._changing.get_all_handlers()

    assert {handler.id for handler in spawning} >= {"observe", "poll_refit", "poll_session"}
    finalizing = {handler.id for handler in [*spawning, *changing] if getattr(handler, "requires_finalizer", False)}
    # A RefitSession alone has one, on purpose: its delete handler makes the members leave the trainer's
    # world and releases the fleet's hold before it goes (docs/proposals/0001-nemo-collective-refits.md).
    assert finalizing == {"on_session_delete"}


def test_a_poll_ends_by_itself_once_its_object_is_gone() -> None:
    """Without a finalizer Kopf never stops these daemons: each must return when its object is gone."""

    class NeverStopped:
        def __bool__(self) -> bool:
            return False

        async def wait(self, timeout: float) -> None:
            pass

    answers = iter([True, True, False])
    calls: list[bool] = []

    async def step() -> bool:
        calls.append(next(answers))
        return calls[-1]

    asyncio.run(asyncio.wait_for(handlers.poll(NeverStopped(), 0, step), timeout=5))  # type: ignore[arg-type]

    assert calls == [True, True, False]


def test_only_the_operators_own_kinds_get_an_essence_a_pod_event_is_not_copied() -> None:
    """Kopf built an essence of every pod event (a deep copy and a sorted dump of its spec) that only
    change handlers and daemons read, and pods have neither."""
    storage = persistence.DigestDiffBase(prefix=names.PREFIX, key="last-handled-configuration", group="megafleet.dev")
    pod = kopf.Body(
        cast(
            kopf.RawBody,
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "uid": "u"}, "spec": {"x": NotToCopy()}},
        )
    )
    assert storage.build(body=pod) == {}
    assert storage.build(body=fleet({"replicas": 2}))["spec"]["sha256"]
    assert handlers.diffbase_storage().group == "megafleet.dev"
