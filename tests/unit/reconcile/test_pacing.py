"""Observation pacing (megafleet.reconcile.pacing, megafleet.handlers.pace): a fleet that changes is
reconciled every observe interval; once settled it is only probed (pods from the cache, agents
asked, no API call), less and less often, and a change an agent reports is still noticed within the
longest probe delay. Run in-process with the delays scaled down; the defaults' bound (8 s plus a 2 s
agent timeout, within the issue's 10 s) is checked on the settings themselves."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from helpers import agent_fakes, kube_fakes
from megafleet import agent_client, handlers, reconcile, settings
from megafleet.fleet_state import pods as pod_view
from megafleet.reconcile import cache, context, pacing

FAST = settings.OperatorSettings(
    triggers=settings.TriggerSettings(observe_interval_seconds=0.1, probe_first_seconds=0.05, probe_most_seconds=0.2)
)


class Agents(agent_fakes.Agents):
    """Agents that answer Ready until ``silent`` (then as the client reports an agent that does not
    answer), counting every state call."""

    def __init__(self) -> None:
        super().__init__()
        self.silent = False
        self.calls = 0

    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        self.calls += len(pod_ips)
        if self.silent:
            return [agent_client.AgentState(error="timed out") for _ in pod_ips]
        return [agent_client.AgentState(state="ready", weight_version=1, served_address=f"{ip}:8000") for ip in pod_ips]

    async def close(self) -> None:
        pass


class Stopped:
    """Kopf's DaemonStopped as :func:`megafleet.handlers.pace` uses it."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout)


def fleet() -> dict[str, Any]:
    return {
        "apiVersion": "megafleet.dev/v1alpha1",
        "kind": "MegatronGeneration",
        "metadata": {"name": "a", "namespace": "rl"},
        "spec": {
            "model": {"source": "/models/m"},
            "replicas": 2,
            "parallelism": {"tensor": 8},
            "resources": {"gpusPerNode": 8},
        },
    }


def node(name: str) -> dict[str, Any]:
    return {
        "kind": "Node",
        "metadata": {"name": name, "labels": {}},
        "spec": {},
        "status": {"allocatable": {"nvidia.com/gpu": "8"}},
    }


class Watched:
    """Fleet ``a`` on a two-node fake cluster with a watch-fed cache, the runtime over it, and the
    reconcile step a pacing daemon runs: after each pass the pods on n0 run and the watch catches up
    (as the scheduler, the kubelet and the watch would); ``reconciles`` holds the passes' times."""

    def __init__(self, agents: Any) -> None:
        self.api = kube_fakes.Api(fleet(), node("n0"), node("n1"))
        self.indexes = kube_fakes.Indexes(self.api)
        watched = cache.Cache(clusterwide=True)
        watched.attach(self.indexes)
        self.runtime = context.Runtime.of(self.api, agents, FAST, cache=watched)
        self.reconciles: list[float] = []

    async def step(self) -> bool:
        body = await self.api.get("MegatronGeneration", "a", "rl") or {}
        await reconcile.reconcile(self.runtime, body)
        self.reconciles.append(time.monotonic())
        self.api.run_pods("n0")
        self.indexes.sync()
        return True


def test_the_default_probe_notices_a_silent_agent_within_ten_seconds() -> None:
    defaults = settings.OperatorSettings()
    assert defaults.triggers.probe_most_seconds + defaults.agents.timeout_seconds <= 10


def test_delays_double_from_the_first_to_the_most() -> None:
    delays: list[float | None] = [None]
    for _ in range(5):
        delays.append(pacing.next_delay(delays[-1], first=2, most=8))
    assert delays[1:] == [2, 4, 8, 8, 8]


def test_a_settled_fleet_is_probed_less_often_and_a_silent_agent_is_noticed() -> None:
    agents = Agents()
    world = Watched(agents)
    api, runtime, reconciles, step = world.api, world.runtime, world.reconciles, world.step

    async def scenario() -> None:
        stopped = Stopped()
        body = await api.get("MegatronGeneration", "a", "rl") or {}
        daemon = asyncio.create_task(handlers.pace(stopped, runtime, body, step))  # type: ignore[arg-type]
        while not (runtime.observed.get(("rl", "a")) or context.Observation(None, "", (), False)).settled:  # type: ignore[arg-type]
            await asyncio.sleep(0.01)
        settled_at, calls, reads = time.monotonic(), agents.calls, sum(api.reads.values())
        count = len(reconciles)
        await asyncio.sleep(1.2)
        # Settled: no reconcile, no API read, and the probe (2 agents) at most every 0.05, 0.1, 0.2, 0.2... s.
        assert len(reconciles) == count
        assert sum(api.reads.values()) == reads
        assert 2 <= (agents.calls - calls) / 2 <= 9  # a reconcile every 0.1 s would be 12 passes
        agents.silent = True
        changed = time.monotonic()
        while len(reconciles) == count:
            await asyncio.sleep(0.01)
        assert reconciles[-1] - changed <= FAST.triggers.probe_most_seconds + 0.1
        assert time.monotonic() - settled_at > 1
        stopped.event.set()
        await daemon

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    status = (asyncio.run(api.get("MegatronGeneration", "a", "rl")) or {})["status"]
    assert status["readyReplicas"] == 0


def test_a_probe_sees_a_pod_the_watch_shows_gone() -> None:
    world = Watched(Agents())
    api, indexes, runtime = world.api, world.indexes, world.runtime
    for _ in range(2):
        current = asyncio.run(api.get("MegatronGeneration", "a", "rl")) or {}
        asyncio.run(reconcile.reconcile(runtime, current))
        api.run_pods("n0")
        indexes.sync()
    body = asyncio.run(api.get("MegatronGeneration", "a", "rl")) or {}
    assert runtime.observed[("rl", "a")].settled
    assert asyncio.run(pacing.probe(runtime, body)) is False

    name = next(key[2] for key in api.objects if key[0] == "Pod")
    api.objects.pop(("Pod", "rl", name))  # killed by someone else; the watch delivers it
    indexes.sync()

    assert asyncio.run(pacing.probe(runtime, body)) is True


class LoadingAgents(Agents):
    """Agents whose engines load until ``loaded``."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded = False

    async def states(self, pod_ips: list[str], token: str) -> list[agent_client.AgentState]:
        if self.loaded:
            return await super().states(pod_ips, token)
        self.calls += len(pod_ips)
        return [agent_client.AgentState(state="loading", weight_version=None) for _ in pod_ips]


def test_a_starting_fleet_is_probed_not_reconciled_until_an_agent_changes() -> None:
    agents = LoadingAgents()
    world = Watched(agents)
    api, runtime, reconciles, step = world.api, world.runtime, world.reconciles, world.step

    async def scenario() -> None:
        stopped = Stopped()
        body = await api.get("MegatronGeneration", "a", "rl") or {}
        daemon = asyncio.create_task(handlers.pace(stopped, runtime, body, step))  # type: ignore[arg-type]
        # The first pass places the pods; the probe after it sees them run, and the second pass
        # finds their engines loading.
        while len(reconciles) < 2 or not getattr(runtime.observed.get(("rl", "a")), "starting", False):
            await asyncio.sleep(0.01)
        count, calls, reads = len(reconciles), agents.calls, sum(api.reads.values())
        await asyncio.sleep(0.6)
        # Loading: probed every 0.1 s (2 agents each), no reconcile, no API read.
        assert len(reconciles) == count
        assert sum(api.reads.values()) == reads
        assert (agents.calls - calls) / 2 >= 3
        agents.loaded = True
        changed = time.monotonic()
        while not getattr(runtime.observed.get(("rl", "a")), "settled", False):
            await asyncio.sleep(0.01)
        assert time.monotonic() - changed <= FAST.triggers.observe_interval_seconds + 0.2
        stopped.event.set()
        await daemon

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    status = (asyncio.run(api.get("MegatronGeneration", "a", "rl")) or {})["status"]
    assert status["readyReplicas"] == 2


def test_a_fleet_waiting_for_gpus_is_not_starting() -> None:
    api = kube_fakes.Api(fleet(), node("n0"))  # room for one of the two shards
    runtime = context.Runtime.of(api, LoadingAgents(), FAST)
    body = asyncio.run(api.get("MegatronGeneration", "a", "rl")) or {}
    asyncio.run(reconcile.reconcile(runtime, body))
    last = runtime.observed[("rl", "a")]
    assert not last.settled and not last.starting  # a timer must retry the placement


def test_a_pod_event_that_changes_nothing_the_reconcile_saw_needs_no_reconcile() -> None:
    api = kube_fakes.Api(fleet(), node("n0"), node("n1"))
    runtime = context.Runtime.of(api, Agents(), FAST)
    assert pacing.pod_unchanged(runtime, "rl", "a", {"metadata": {"name": "x"}}) is False  # no reconcile yet
    body = asyncio.run(api.get("MegatronGeneration", "a", "rl")) or {}
    asyncio.run(reconcile.reconcile(runtime, body))
    name = next(key[2] for key in api.objects if key[0] == "Pod")
    pod = api.objects[("Pod", "rl", name)]

    assert pacing.pod_unchanged(runtime, "rl", "a", pod)  # the watch confirming the create
    bound = {**pod, "spec": {**pod["spec"], "nodeName": pod_view.pinned_node(pod)}}
    assert pacing.pod_unchanged(runtime, "rl", "a", bound)  # bound where it was pinned
    running = {**bound, "status": {"phase": "Running", "podIP": "127.0.0.9"}}
    assert not pacing.pod_unchanged(runtime, "rl", "a", running)
    deleting = {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "now"}}
    assert not pacing.pod_unchanged(runtime, "rl", "a", deleting)
