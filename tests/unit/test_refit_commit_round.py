"""The trainer's commit on the megafleet wire, as messages (:mod:`megafleet_protocol.refit.commit_round`,
:mod:`megafleet_protocol.refit.round_messages`): a receiver's ``staged/<r>`` and the trainer's
``commit`` round-trip; a hello asks for the trainer's commit and a decision says the trainer commits,
while those of peers older than the two-phase commit ask and say nothing; malformed ones are protocol
errors. The wire itself runs in tests/refit/test_refit_trainer_commit.py."""

from __future__ import annotations

import pytest

from megafleet_protocol.refit import commit_round, errors, round_messages


@pytest.mark.parametrize(
    "staged",
    [
        commit_round.Staged(ok=True),
        commit_round.Staged(ok=False, error="bucket 2 (of 7) does not match", mismatch="bucket 2"),
    ],
)
def test_a_staged_report_round_trips(staged: commit_round.Staged) -> None:
    assert commit_round.Staged.decode(staged.encode()) == staged


@pytest.mark.parametrize("decision", [commit_round.Commit(go=True), commit_round.Commit(False, "rank 1: bucket 2")])
def test_a_commit_round_trips(decision: commit_round.Commit) -> None:
    assert commit_round.Commit.decode(decision.encode().encode()) == decision


@pytest.mark.parametrize("raw", [b"{}", b'{"go": true}', b"[1]", b"not json"])
def test_a_malformed_commit_is_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(errors.ProtocolError, match="malformed commit message"):
        commit_round.Commit.decode(raw)
    with pytest.raises(errors.ProtocolError, match="malformed staged message"):
        commit_round.Staged.decode(raw)


def test_the_keys_live_in_the_round() -> None:
    assert (commit_round.staged_key(3), commit_round.COMMIT_KEY) == ("staged/3", "commit")


def test_a_hello_asks_for_the_trainers_commit_and_an_old_one_asks_nothing() -> None:
    hello = round_messages.Hello("s", "g", "m", ("mf64",), commit=True)
    assert round_messages.Hello.decode(hello.encode().encode()) == hello
    old = b'{"session": "s", "group": null, "manifest": null, "checksums": []}'
    assert round_messages.Hello.decode(old).commit is False


def test_a_decision_says_the_trainer_commits_and_an_old_one_says_nothing() -> None:
    decision = round_messages.Decision("v3", keep=False, manifest=None, commit=True)
    assert round_messages.Decision.decode(decision.encode().encode()) == decision
    assert round_messages.Decision.decode(b'{"group": "v3", "keep": true, "manifest": null}').commit is False
