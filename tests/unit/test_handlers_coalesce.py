"""Triggers of one fleet that arrive while a reconcile of it waits for the fleet's lock are folded
into that reconcile (megafleet.handlers._reconcile): a burst of pod events costs one reconcile."""

from __future__ import annotations

import asyncio

from helpers import agent_fakes, kube_fakes
from megafleet import handlers, settings
from megafleet.reconcile import context


def going_fleet() -> tuple[kube_fakes.Api, context.Runtime]:
    """A fleet being deleted (a reconcile of it reads it and stops) and a runtime over it."""
    going = {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "MegatronGeneration",
        "metadata": {"name": "a", "namespace": "rl", "deletionTimestamp": "2026-12-01T00:00:00Z"},
        "spec": {},
    }
    api = kube_fakes.Api(going)
    return api, context.Runtime.of(api, agent_fakes.Agents(), settings.OperatorSettings())


def test_triggers_waiting_for_the_lock_are_folded_into_one_reconcile() -> None:
    api, runtime = going_fleet()

    async def scenario() -> list[bool]:
        lock = runtime.fleet_lock("rl", "a")
        await lock.acquire()  # a reconcile (or Refit step) of the fleet is running
        triggers = [asyncio.create_task(handlers._reconcile(runtime, "rl", "a")) for _ in range(5)]
        await asyncio.sleep(0)
        lock.release()
        return await asyncio.gather(*triggers)

    outcomes = asyncio.run(scenario())

    assert api.reads["get MegatronGeneration"] == 1  # one reconcile read the fleet
    assert outcomes.count(False) == 1 and outcomes.count(True) == 4  # it found the fleet going
    assert runtime.waiting == set()


def test_pod_event_triggers_within_the_gather_window_are_one_reconcile() -> None:
    api, runtime = going_fleet()

    async def scenario() -> list[bool]:
        # No reconcile runs: the first trigger waits out its window, the rest arrive within it.
        first = asyncio.create_task(handlers._reconcile(runtime, "rl", "a", gather=0.2))
        await asyncio.sleep(0)
        later = [asyncio.create_task(handlers._reconcile(runtime, "rl", "a", gather=0.2)) for _ in range(4)]
        return await asyncio.gather(first, *later)

    outcomes = asyncio.run(scenario())

    assert api.reads["get MegatronGeneration"] == 1
    assert outcomes == [False, True, True, True, True]
    assert runtime.waiting == set()


def test_a_trigger_that_only_needs_a_reconcile_leaves_it_to_the_one_running() -> None:
    """The creation (or resumption) trigger and the observation daemon's first pass start together
    (with 125 fleets created at once, each was reconciled twice as it was created); a spec change still waits for
    the running reconcile and then runs its own, since that one may have read the old spec."""
    api, runtime = going_fleet()

    async def scenario() -> tuple[bool, bool]:
        lock = runtime.fleet_lock("rl", "a")
        await lock.acquire()  # a reconcile of the fleet is running
        idle_only = asyncio.create_task(handlers._reconcile(runtime, "rl", "a", if_idle=True))
        spec_change = asyncio.create_task(handlers._reconcile(runtime, "rl", "a"))
        await asyncio.sleep(0)
        assert idle_only.done() and api.reads["get MegatronGeneration"] == 0
        lock.release()
        return await idle_only, await spec_change

    assert asyncio.run(scenario()) == (True, False)  # the spec change's own reconcile found the fleet going
    assert api.reads["get MegatronGeneration"] == 1
