"""The trainer's commit over gloo (``commit: trainer``): two real engine processes
(``python -m megafleet_engine.cli`` with a staging copy, ``MEGAFLEET_REFIT_STAGING=auto``) stage a
version while serving, report ``staged/<r>`` and switch only when the SDK's
:class:`~megafleet_protocol.refit.sender.WeightSender` writes ``commit``.

A bucket that does not verify on one receiver only (reshard, the sender's test hook flips a byte of
that receiver's bucket) makes the trainer refuse the commit: neither engine switches, both serve the
old version on, neither goes stale. A trainer that never commits (it withholds the commit, its store
still up) leaves both on the old version once their deadline plus the grace has passed. A complete
refit afterwards succeeds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers import refit_harness as harness
from megafleet_protocol.refit import errors
from megafleet_protocol.refit import sender as sdk

pytestmark = pytest.mark.slow  # each test starts engines and a process group

SOURCE = "tiny://llama?hidden=256&heads=4&kv_heads=2&intermediate=512"  # 5 MiB: seven buckets of 1 MiB
PROMPT = [40, 41, 42, 43]
TOKENS = 5


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[harness.EngineProcess]]:
    token = harness.token_file(tmp_path_factory.mktemp("agent"))
    staged = {"MEGAFLEET_REFIT_STAGING": "auto"}
    running = [harness.EngineProcess(f"127.0.17.{index}", token, source=SOURCE, env=staged) for index in (1, 2)]
    try:
        for engine in running:
            engine.wait_serving()
        yield running
    finally:
        for engine in running:
            engine.close()


def trainer(seed: int) -> harness.Trainer:
    return harness.Trainer(f"{SOURCE}&seed={seed}")


def open_sender(**hooks: object) -> sdk.WeightSender:
    sender = sdk.WeightSender(
        harness.free_port(),
        3,
        address=harness.TRAINER_ADDRESS,
        timeout_seconds=60,
        **hooks,  # type: ignore[arg-type]
    )
    sender.init()
    return sender


def prepare(
    engines: list[harness.EngineProcess],
    sender: sdk.WeightSender,
    version: int,
    *,
    transport: str = "broadcast",
    timeout_seconds: int = 60,
    **more: object,
) -> None:
    """Every engine joins the sender's rendezvous, staged, verified and waiting for the trainer's
    commit (``more``: further body fields by their wire names)."""
    for offset, engine in enumerate(engines, start=1):
        accepted = engine.agent.prepare(
            version,
            port=sender.rendezvous.port,
            world_size=sender.rendezvous.world_size,
            rank_offset=offset,
            timeout_seconds=timeout_seconds,
            transport=transport,
            integrity="checksum",
            suspend_mode="keep",
            kv_cache_mode="persist",
            more={"staging": "auto", "commit": "trainer", **more},
        )
        assert accepted.status_code == 202, accepted.text


def serves(engines: list[harness.EngineProcess], model: harness.Trainer, version: int) -> bool:
    expected = (model.greedy(PROMPT, TOKENS), str(version))
    return all(harness.completion_ids(engine.frontend_url, PROMPT, TOKENS) == expected for engine in engines)


def test_a_trainers_commit_switches_every_receiver_after_all_staged(engines: list[harness.EngineProcess]) -> None:
    model = trainer(71)
    sender = open_sender()
    try:
        prepare(engines, sender, 1)
        report = sender.send(model.weights().items(), bucket_size_mib=1, version=1)
    finally:
        sender.close()

    assert report.verified
    statuses = [engine.agent.wait_finished() for engine in engines]
    for status in statuses:
        assert status["phase"] == "succeeded", status
        assert status["staging"]["effective"] == "staged"
        assert status["commit"] == {
            "requested": "trainer",
            "effective": "trainer",
            "reason": None,
            "committed": True,
            "expired": False,
        }
    assert serves(engines, model, 1)


def test_a_bucket_corrupt_on_one_receiver_switches_no_receiver(engines: list[harness.EngineProcess]) -> None:
    first = trainer(71)  # what test_a_trainers_commit... left them serving
    if not serves(engines, first, 1):
        pytest.skip("runs after test_a_trainers_commit_switches_every_receiver_after_all_staged")
    sender = open_sender(corrupt_bucket=2, corrupt_receiver=1)  # group rank 1: the first engine only
    try:
        prepare(engines, sender, 2, transport="reshard")
        with pytest.raises(errors.ReceiverFailed) as failed:
            sender.send(trainer(72).weights().items(), bucket_size_mib=1, version=2, transport="reshard")
    finally:
        sender.close()

    assert list(failed.value.reasons) == [1], failed.value  # only that receiver did not stage
    corrupt, clean = (engine.agent.wait_finished() for engine in engines)
    assert corrupt["phase"] == "failed" and corrupt["verification"]["mismatch"]["bucket"] == 2, corrupt
    assert clean["phase"] == "failed" and "the trainer did not commit: rank 1:" in clean["error"], clean
    assert not clean["commit"]["committed"]
    for status in (corrupt, clean):
        assert (status["state"], status["weightVersion"], status["dirty"]) == ("ready", 1, False), status
    assert serves(engines, first, 1), "a receiver switched although the trainer did not commit"


def test_a_trainer_that_never_commits_leaves_every_receiver_on_its_version_after_the_grace(
    engines: list[harness.EngineProcess],
) -> None:
    first = trainer(71)
    if not serves(engines, first, 1):
        pytest.skip("runs after test_a_trainers_commit_switches_every_receiver_after_all_staged")
    sender = open_sender(withhold_commit=True)  # its store stays up: the receivers wait out the grace
    try:
        prepare(engines, sender, 3, timeout_seconds=10, commitGraceSeconds=5)
        with pytest.raises(errors.RefitAborted, match="withheld its commit"):
            sender.send(trainer(73).weights().items(), bucket_size_mib=1, version=3)
        statuses = [engine.agent.wait_finished(timeout=60) for engine in engines]
    finally:
        sender.close()

    for status in statuses:
        assert status["phase"] == "failed" and status["error"].startswith("CommitExpired:"), status
        assert status["commit"]["expired"] and not status["commit"]["committed"]
        assert (status["state"], status["weightVersion"], status["dirty"]) == ("ready", 1, False), status
    assert serves(engines, first, 1)

    repaired, model = open_sender(), trainer(74)  # a complete refit afterwards
    try:
        prepare(engines, repaired, 4)
        repaired.send(model.weights().items(), bucket_size_mib=1, version=4)
    finally:
        repaired.close()
    assert [engine.agent.wait_finished()["phase"] for engine in engines] == ["succeeded"] * 2
    assert serves(engines, model, 4)
