"""Shared test helper (it holds no tests): :class:`Agents`, the base of the unit tests' stand-ins for
:class:`megafleet.agent_client.AgentClient`, the operator's client of the pods' agents.

A test subclasses it and overrides the calls its scenario reaches (``states``, ``suspend``,
``refit_status``, ...), answering as the pods' agents would. It reaches no network: a call the test
did not override fails the test.
"""

from __future__ import annotations

from typing import Any, NoReturn

from megafleet import agent_client


class Agents(agent_client.AgentClient):
    """Agents that answer nothing until a subclass says what they answer."""

    def __init__(self) -> None:
        super().__init__(timeout_seconds=1.0)

    async def _call(
        self, method: str, url: str, *, json: Any = None, headers: dict[str, str], timeout: float | None = None
    ) -> NoReturn:
        raise AssertionError(f"the test's agents were not told how to answer {method} {url}")
