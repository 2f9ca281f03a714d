"""What the ranks write in the trainer's store to open a round: each receiver's :class:`Hello` and
the trainer's :class:`Decision`, and the keys they go under.

Called by :meth:`Communicator.open_round <megafleet_protocol.refit.communicator.Communicator.open_round>`
(every rank) and by the trainer's :mod:`~megafleet_protocol.refit.sender`, which deletes a finished
round's keys. Both messages are JSON; a malformed one is a
:class:`~megafleet_protocol.refit.errors.ProtocolError`. docs/refit-protocol.md ("Session, rounds
and group reuse") tells what they decide. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import json

from megafleet_protocol.refit import errors

__all__ = ["GROUP_KEY", "Decision", "Hello", "hello_key"]

GROUP_KEY = "group"
"""The trainer's decision of a round: ``{"group": name, "keep": bool}``."""


def hello_key(group_rank: int) -> str:
    return f"hello/{group_rank}"


@dataclasses.dataclass(frozen=True)
class Hello:
    """A receiver's opening of a round: the session it read, the group it still holds, the
    manifest it accepted last (its id, see :meth:`Communicator.open_round`), the digests it asks
    the trainer to seal its buckets with (empty: none; a receiver older than digests sends no such
    field) and whether it waits for the trainer's commit after it staged (``commit``; a receiver
    older than the two-phase commit sends no such field and switches on its own)."""

    session: str
    group: str | None
    manifest: str | None = None
    checksums: tuple[str, ...] = ()
    commit: bool = False

    def encode(self) -> str:
        return json.dumps(
            {
                "session": self.session,
                "group": self.group,
                "manifest": self.manifest,
                "checksums": list(self.checksums),
                "commit": self.commit,
            }
        )

    @classmethod
    def decode(cls, raw: bytes) -> Hello:
        try:
            value = json.loads(raw)
            checksums = value.get("checksums") or []
            if not isinstance(checksums, list):
                raise TypeError(f"checksums is {checksums!r}, not a list")
            return cls(
                str(value["session"]),
                _optional_str(value["group"]),
                _optional_str(value.get("manifest")),
                tuple(str(name) for name in checksums),
                bool(value.get("commit", False)),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise errors.ProtocolError(f"malformed hello: {error!r}") from None


@dataclasses.dataclass(frozen=True)
class Decision:
    """The trainer's decision for a round: the group every rank uses, whether it is kept, the
    manifest every receiver already holds (``None``: the manifest exchange follows) and whether the
    trainer commits for the receivers that asked (``commit``; a trainer older than the two-phase
    commit sends no such field, and a receiver waiting for its commit fails at once instead of
    waiting out its grace)."""

    group: str
    keep: bool
    manifest: str | None = None
    commit: bool = False

    def encode(self) -> str:
        return json.dumps({"group": self.group, "keep": self.keep, "manifest": self.manifest, "commit": self.commit})

    @classmethod
    def decode(cls, raw: bytes) -> Decision:
        try:
            value = json.loads(raw)
            return cls(
                str(value["group"]),
                bool(value["keep"]),
                _optional_str(value.get("manifest")),
                bool(value.get("commit", False)),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise errors.ProtocolError(f"malformed group decision: {error!r}") from None


def _optional_str(value: object) -> str | None:
    return None if value is None else str(value)
