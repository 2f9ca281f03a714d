"""The trainer's commit on the megafleet wire: after the buckets, every receiver that staged says so
(``staged/<r>``), the trainer decides once for all of them (``commit``), and only then does any of
them switch to the new version.

A receiver asks for this in its round's hello (``Hello.commit``: its refit stages and its commit is
the trainer's, ``commit: trainer``); one that receives in place cannot wait, asks nothing and switches
on its own as before. The keys live in the round's namespace of the trainer's rendezvous store, beside
``done/<r>`` (which every receiver still writes once it serves the version, or failed):

* receiver: :func:`report_staged` writes its :class:`Staged` (verified and settled, or why not), and
  :func:`await_commit` waits for the trainer's :class:`Commit` until its deadline (the attempt's plus
  its grace): a go returns, a no-go raises :class:`~megafleet_protocol.refit.errors.RefitAborted`, and
  no decision raises :class:`~megafleet_protocol.refit.errors.CommitExpired` (a trainer that died
  takes its store with it: the wait fails at once). Either way nothing of the new version went live;
* trainer (:mod:`~megafleet_protocol.refit.sender`): :func:`decide` reads every asking receiver's
  ``staged/<r>`` and writes ``commit``: go only if all staged, else no-go naming the failures (and
  raises :class:`~megafleet_protocol.refit.errors.ReceiverFailed`).

docs/refit-protocol.md ("The two-phase commit") draws the round. Imports no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

from megafleet_protocol.refit import errors

if TYPE_CHECKING:
    from megafleet_protocol.refit import communicator, deadlines

__all__ = ["COMMIT_KEY", "Commit", "Staged", "await_commit", "decide", "report_staged", "staged_key"]

COMMIT_KEY = "commit"
"""The trainer's decision of a round (:class:`Commit`)."""


def staged_key(group_rank: int) -> str:
    return f"staged/{group_rank}"


@dataclasses.dataclass(frozen=True)
class Staged:
    """A receiver's report once its staging copy holds the whole version (``ok``), or why it does not
    (``error``; ``mismatch``: the bucket that did not verify, as the error names it)."""

    ok: bool
    error: str = ""
    mismatch: str = ""

    def encode(self) -> str:
        return json.dumps({"ok": self.ok, "error": self.error, "mismatch": self.mismatch})

    @classmethod
    def decode(cls, raw: bytes | str) -> Staged:
        try:
            value = json.loads(raw)
            return cls(bool(value["ok"]), str(value["error"]), str(value.get("mismatch") or ""))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise errors.ProtocolError(f"malformed staged message: {error!r}") from None


@dataclasses.dataclass(frozen=True)
class Commit:
    """The trainer's decision: every receiver switches (``go``), or none does (``reason``)."""

    go: bool
    reason: str = ""

    def encode(self) -> str:
        return json.dumps({"go": self.go, "reason": self.reason})

    @classmethod
    def decode(cls, raw: bytes | str) -> Commit:
        try:
            value = json.loads(raw)
            return cls(bool(value["go"]), str(value["reason"]))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise errors.ProtocolError(f"malformed commit message: {error!r}") from None


def report_staged(comm: communicator.Communicator, staged: Staged, *, namespace: str | None = None) -> None:
    """Write this receiver's :class:`Staged` in the current round (or the round ``namespace``)."""
    comm.set(staged_key(comm.group_rank), staged.encode(), namespace=namespace)


def await_commit(comm: communicator.Communicator, deadline: deadlines.Deadline) -> None:
    """Wait for the trainer's commit of the current round until ``deadline``: return on go; raise
    :class:`RefitAborted` on no-go, :class:`CommitExpired` when none came in time."""
    attempt_deadline, comm.deadline = comm.deadline, deadline
    try:
        raw = comm.get(COMMIT_KEY, what="the trainer's commit")
    except errors.RefitTimeout:
        raise errors.CommitExpired(
            f"CommitExpired: the trainer's commit did not come within {deadline.seconds:g} s after the "
            "staging; the staged copy is discarded and the old version serves on"
        ) from None
    finally:
        comm.deadline = attempt_deadline
    decision = Commit.decode(raw)
    if not decision.go:
        raise errors.RefitAborted(f"the trainer did not commit: {decision.reason or 'no reason given'}")


def decide(comm: communicator.Communicator, ranks: Iterable[int]) -> None:
    """Trainer: read the ``staged/<r>`` of every group rank in ``ranks`` (until the send's deadline)
    and write the commit: go when every one staged, else no-go, then raise :class:`ReceiverFailed`."""
    failed: dict[int, str] = {}
    for group_rank in sorted(ranks):
        global_rank = comm.rendezvous.global_rank(group_rank)
        try:
            raw = comm.get(staged_key(group_rank), what=f"the staged report of rank {global_rank}")
        except errors.RefitError as error:  # the others need not wait for their grace to learn it
            _refuse(comm, f"rank {global_rank}: {error}")
            raise
        try:
            staged = Staged.decode(raw)
        except errors.ProtocolError as error:
            failed[global_rank] = str(error)
            continue
        if not staged.ok:
            failed[global_rank] = staged.error or "it did not stage"
    reason = "; ".join(f"rank {rank}: {error}" for rank, error in sorted(failed.items()))
    comm.set(COMMIT_KEY, Commit(go=not failed, reason=reason).encode())
    if failed:
        raise errors.ReceiverFailed(failed)


def _refuse(comm: communicator.Communicator, reason: str) -> None:
    """Write a no-go (best effort: the store may be what failed)."""
    with contextlib.suppress(RuntimeError, errors.RefitError):
        comm.set(COMMIT_KEY, Commit(go=False, reason=reason).encode())
