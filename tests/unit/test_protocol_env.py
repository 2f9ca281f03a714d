"""The ``MEGAFLEET_*`` contract: the env the operator writes on an engine pod is env the engine reads.

The operator's pod builder (:func:`megafleet.desired.shard_pods`) and the engine's settings reader
(:func:`megafleet_protocol.engine_settings.from_env`) both name the variables through
:mod:`megafleet_protocol.env`; this test runs one into the other, so a name that drifts on either
side (or a constant that neither side uses) fails here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

from megafleet import desired, planner
from megafleet.api import v1alpha1
from megafleet.objects import Object
from megafleet_protocol import engine_settings as settings
from megafleet_protocol import env

POD_IP = "10.0.0.7"
API_KEY = "sk-test"


class Recording(Mapping[str, str]):
    """An environment that remembers every variable asked for."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)
        self.asked: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        return self._values[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.asked.add(key)
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def pod_env(pod: Object) -> dict[str, str]:
    """The pod's env as the kubelet resolves it (the pod IP and the API key Secret filled in)."""
    resolved = {}
    for item in pod["spec"]["containers"][0]["env"]:
        source = item.get("valueFrom", {})
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "status.podIP"
            resolved[item["name"]] = POD_IP
        elif "secretKeyRef" in source:
            resolved[item["name"]] = API_KEY
        else:
            resolved[item["name"]] = item["value"]
    return resolved


def sample_pods() -> list[Object]:
    raw = {
        "model": {"source": "/models/m", "servedName": "policy"},
        "parallelism": {"tensor": 8},
        "resources": {"gpusPerNode": 4},
        "engine": {"kvCacheMode": "offload"},
        "frontend": {"apiKeySecret": {"name": "keys", "key": "api"}},
    }
    fleet = desired.ParsedFleet("gen", "rl", "uid-1", 1, v1alpha1.MegatronGenerationSpec.model_validate(raw))
    placement = planner.ShardPlacement(clique=None, pods=(planner.PodPlacement("n0", 4), planner.PodPlacement("n1", 4)))
    return desired.shard_pods(fleet, 1, placement)


def constants() -> set[str]:
    return {
        value for name, value in vars(env).items() if name.isupper() and isinstance(value, str) and name != "PREFIX"
    }


def test_every_variable_the_operator_writes_is_one_the_engine_reads() -> None:
    for index, pod in enumerate(sample_pods()):
        everything = pod_env(pod)
        # Beside the protocol, the operator points the libraries' caches at writable volumes.
        assert {name for name in everything if not name.startswith(env.PREFIX)} == set(desired.CACHE_ENV)
        written = {name: value for name, value in everything.items() if name.startswith(env.PREFIX)}
        environ = Recording(written)
        read = settings.from_env(environ)
        assert set(written) - set(env.INFORMATIONAL) <= environ.asked, "written but never read by the engine"
        assert not environ.asked & set(env.INFORMATIONAL)
        assert {env.MODEL_SOURCE, env.HOST, env.AGENT_TOKEN_FILE} <= set(written)  # what the engine requires
        assert set(written) <= constants()  # every name the operator writes is a protocol constant
        assert (read.model_name, read.host, read.api_key, read.kv_cache_mode) == ("policy", POD_IP, API_KEY, "offload")
        assert (read.rank, read.world_size, read.local_gpus, read.tensor_parallel) == (index * 4, 8, 4, 8)


def test_every_protocol_name_is_read_by_the_engine_or_informational() -> None:
    environ = Recording({env.MODEL_SOURCE: "tiny://llama"})
    settings.from_env(environ)
    assert constants() == environ.asked | set(env.INFORMATIONAL)
    assert all(name.startswith(env.PREFIX) for name in constants())


def test_every_name_is_the_operators_the_users_or_informational_and_the_users_are_documented() -> None:
    """``env.USER_SETTINGS`` is what a fleet's ``spec.engine.env`` may set: every name the operator
    does not, each listed in docs/operations.md's settings table."""
    assert set(env.SET_BY_OPERATOR) | set(env.USER_SETTINGS) | set(env.INFORMATIONAL) == constants()
    assert not set(env.SET_BY_OPERATOR) & set(env.USER_SETTINGS)
    documented = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    assert [name for name in env.USER_SETTINGS if f"| `{name}` |" not in documented] == []
