"""Shared test helper (it holds no tests): Kopf's API credentials for a loopback test server."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from kopf._cogs.clients import auth
from kopf._cogs.structs import credentials


@contextlib.asynccontextmanager
async def kopf_context(server: str) -> AsyncIterator[None]:
    """Kopf's credentials for ``server``, as its authentication activity would leave them, so Kopf's
    own API calls (watches, lists) go to ``server``."""
    vault = credentials.Vault()
    await vault.populate({"test": credentials.ConnectionInfo(server=server)})
    token = auth.vault_var.set(vault)
    try:
        yield
    finally:
        auth.vault_var.reset(token)
        await vault.close()
