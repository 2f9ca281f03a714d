"""The trainer's refit info as the operator reads it: from the session's ConfigMap, checked.

NeMo RL's ``prepare_refit_info`` (written by :mod:`megafleet.sdk.nemo.refit_info`) is gzip'd JSON
``[[name, shape, dtype], ...]`` under the ConfigMap key ``spec.refitInfo`` names, with its sha256
and tensor count. The RefitSession controller checks it once, in the Joined phase (:func:`accept`:
``RefitInfoAccepted``, or the session ``Broken``, ``RefitInfoRejected``); each Refit through a NeMo
session reads it again for the members' request (:func:`read`, from :mod:`.session_refits`).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json

import pydantic

from megafleet import conditions, kube
from megafleet.refits import context, session_end, session_status, session_view
from megafleet_protocol import agent_api


class RefitInfoError(ValueError):
    """``spec.refitInfo`` cannot be used; ``missing``: its ConfigMap (or key) does not exist (yet)."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


async def read(api: kube.Api, session: session_view.Session) -> list[agent_api.NemoTensor]:
    """The trainer's ``prepare_refit_info`` from the session's ConfigMap: gzip'd JSON
    ``[[name, shape, dtype], ...]`` under ``binaryData[key]``, checked against ``sha256`` and
    ``tensors``. Raises :class:`RefitInfoError`."""
    ref = session.spec.refit_info
    if ref is None:
        raise RefitInfoError(f"RefitSession {session.name} has no refitInfo yet", missing=True)
    source = f"ConfigMap {ref.config_map_ref.name} key {ref.config_map_ref.key}"
    found = await api.get("ConfigMap", ref.config_map_ref.name, session.namespace)
    encoded = ((found or {}).get("binaryData") or {}).get(ref.config_map_ref.key)
    if encoded is None:
        raise RefitInfoError(f"{source} does not exist", missing=True)
    return parse(base64.b64decode(encoded), sha256=ref.sha256, tensors=ref.tensors, source=source)


def parse(packed: bytes, *, sha256: str, tensors: int, source: str) -> list[agent_api.NemoTensor]:
    """The refit info in ``packed`` (gzip'd JSON), checked; :class:`RefitInfoError` names what is wrong."""
    digest = hashlib.sha256(packed).hexdigest()
    if digest != sha256:
        raise RefitInfoError(f"{source}: sha256 {digest} is not refitInfo.sha256 {sha256}")
    try:
        entries = json.loads(gzip.decompress(packed))
    except (OSError, EOFError, ValueError) as error:
        raise RefitInfoError(f"{source} is not gzip'd JSON: {error}") from None
    if not isinstance(entries, list) or len(entries) != tensors:
        count = len(entries) if isinstance(entries, list) else "no list of"
        raise RefitInfoError(f"{source} holds {count} tensors, refitInfo.tensors says {tensors}")
    try:
        return [agent_api.NemoTensor(name=name, shape=shape, dtype=dtype) for name, shape, dtype in entries]
    except (TypeError, ValueError, pydantic.ValidationError) as error:
        raise RefitInfoError(f"{source}: an entry is not [name, shape, dtype]: {error}") from None


async def accept(ctx: context.SessionContext) -> bool:
    """Check ``spec.refitInfo`` once; False once the session ended on it (a missing ConfigMap only
    waits: the trainer may write it after the spec)."""
    try:
        info = await read(ctx.api, ctx.session)
    except RefitInfoError as error:
        if error.missing:
            await ctx.write(session_status.refit_info_waiting(ctx.session, str(error), conditions.now()))
            return True
        reason = session_status.REFIT_INFO_REJECTED
        await session_end.end(ctx.api, ctx.agents, ctx.session, phase="Broken", reason=reason, message=str(error))
        return False
    await ctx.write(session_status.refit_info_accepted(ctx.session, len(info), conditions.now()))
    return True
