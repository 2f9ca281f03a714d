"""The local pod runner reports an engine that exited as a kubelet does, termination message
included, and the operator's pod view reads the engine's reason back from it."""

from __future__ import annotations

from pathlib import Path

from megafleet.fleet_state import pods
from megafleet_dev import runner

REASON = "invalid configuration: MEGAFLEET_FUSED_KERNELS must be one of rope-swiglu, off, gemv, all, got 'rm -rf /'"


def pod() -> dict[str, object]:
    return {
        "metadata": {"name": "tiny-s0-p0", "labels": {"megafleet.dev/shard": "0"}},
        "spec": {"containers": [{"name": "engine", "image": "megafleet/engine:0.1.0"}]},
        "status": {"phase": "Running", "podIP": "127.0.0.2"},
    }


def test_an_engine_that_exits_leaves_its_reason_in_the_pods_status(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.write_text(REASON + "\n")
    status = runner.exit_status(pod(), 2, log)
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert (status["phase"], terminated["exitCode"], terminated["message"]) == ("Failed", 2, REASON)
    assert pods.parse({**pod(), "status": status}, clique_label="c").exit_reason == REASON


def test_without_a_message_the_exit_code_or_signal_is_the_reason(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.touch()
    killed = runner.exit_status(pod(), -9, log)
    assert pods.parse({**pod(), "status": killed}, clique_label="c").exit_reason == "Error (exit code 137)"
    missing = runner.exit_status(pod(), 1, tmp_path / "absent")
    assert pods.parse({**pod(), "status": missing}, clique_label="c").exit_reason == "Error (exit code 1)"
