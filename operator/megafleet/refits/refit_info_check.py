"""The trainer's refit info as the operator reads it: from the session's ConfigMap, checked.

NeMo RL's ``prepare_refit_info`` (written by :mod:`megafleet.sdk.nemo.refit_info`) is gzip'd JSON
``[[name, shape, dtype], ...]`` under the ConfigMap key ``spec.refitInfo`` names, with its sha256
and tensor count. The RefitSession controller checks it once, in the Joined phase (:func:`accept`:
``RefitInfoAccepted``, or the session ``Broken``, ``RefitInfoRejected``); each Refit through a NeMo
session reads it again for the members' request (:func:`read`, from :mod:`.session_refits`).

The ConfigMap is the user's (up to 1 MiB), and deflate expands about a thousand times, so nothing is
expanded or parsed beyond what ``refitInfo.tensors`` entries can take: the gzip is inflated a piece
at a time up to :func:`expanded_bound` and refused past it, and the JSON array is read one entry at
a time, refused past the count. A bomb ends the session ``Broken`` (``RefitInfoRejected``, naming the
ConfigMap) with the operator's memory flat.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic

from megafleet import conditions, kube
from megafleet.api import v1alpha1
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
    data, source = await packed(api, session.namespace, ref)
    return parse(data, sha256=ref.sha256, tensors=ref.tensors, source=source)


async def packed(api: kube.Api, namespace: str, ref: v1alpha1.RefitInfoRef) -> tuple[bytes, str]:
    """The gzip'd bytes ``ref`` names (a ConfigMap's ``binaryData`` key) and a name for them in
    errors; :class:`RefitInfoError` (``missing``) while the ConfigMap or its key does not exist."""
    source = f"ConfigMap {ref.config_map_ref.name} key {ref.config_map_ref.key}"
    found = await api.get("ConfigMap", ref.config_map_ref.name, namespace)
    encoded = ((found or {}).get("binaryData") or {}).get(ref.config_map_ref.key)
    if encoded is None:
        raise RefitInfoError(f"{source} does not exist", missing=True)
    return base64.b64decode(encoded), source


MAX_EXPANDED_BYTES = 64 * 1024 * 1024
"""The most refit info the operator inflates, whatever ``refitInfo.tensors`` says (a 235B MoE's is
a few MB)."""
ENTRY_BYTES = 2048
"""The room :func:`expanded_bound` gives each tensor: an entry ``["model.layers.0.mlp.up_proj.weight",
[14336, 4096], "bfloat16"]`` takes about 60 bytes; names run to 1,024 characters."""
_CHUNK = 64 * 1024
"""The gzip'd bytes inflated at a time."""
_PIECE = 1024 * 1024
"""The most output one inflate step makes (zlib builds it twice over before handing it back)."""


def parse(packed: bytes, *, sha256: str, tensors: int, source: str) -> list[agent_api.NemoTensor]:
    """The refit info in ``packed`` (gzip'd JSON), checked; :class:`RefitInfoError` names what is wrong."""
    digest = hashlib.sha256(packed).hexdigest()
    if digest != sha256:
        raise RefitInfoError(f"{source}: sha256 {digest} is not refitInfo.sha256 {sha256}")
    bound = expanded_bound(tensors)
    try:
        text = gunzip(packed, bound=bound).decode()
    except ExpandsTooFar:
        raise RefitInfoError(
            f"{source} expands past {bound} bytes ({len(packed)} gzip'd), more than refitInfo.tensors {tensors} "
            "entries can take: refused unread (a decompression bomb?)"
        ) from None
    except (OSError, EOFError, ValueError, zlib.error) as error:
        raise RefitInfoError(f"{source} is not gzip'd JSON: {error}") from None
    entries = _entries(text, tensors=tensors, source=source)
    try:
        return [agent_api.NemoTensor(name=name, shape=shape, dtype=dtype) for name, shape, dtype in entries]
    except (TypeError, ValueError, pydantic.ValidationError) as error:
        raise RefitInfoError(f"{source}: an entry is not [name, shape, dtype]: {error}") from None


def expanded_bound(tensors: int) -> int:
    """The most bytes the refit info of ``tensors`` entries may inflate to: :data:`ENTRY_BYTES` each,
    at most :data:`MAX_EXPANDED_BYTES`."""
    return min(MAX_EXPANDED_BYTES, max(tensors, 1) * ENTRY_BYTES)


class ExpandsTooFar(ValueError):
    """The gzip'd data inflates past the bound it was read with."""


def gunzip(packed: bytes, *, bound: int) -> bytes:
    """``packed`` inflated (every gzip member, as :func:`gzip.decompress`), never holding more than
    ``bound`` bytes of output: :class:`ExpandsTooFar` past it. Raises :class:`zlib.error` or
    :class:`EOFError` on data that is not (whole) gzip."""
    pieces: list[bytes] = []
    size = 0
    rest = memoryview(packed)
    while len(rest):
        inflater = zlib.decompressobj(wbits=zlib.MAX_WBITS | 16)
        while not inflater.eof:
            if not len(rest) and not inflater.unconsumed_tail:
                raise EOFError("the gzip data ends before its last member does")
            most = min(_PIECE, bound + 1 - size)
            if inflater.unconsumed_tail:  # held back by the output bound
                piece = inflater.decompress(inflater.unconsumed_tail, most)
            else:
                piece = inflater.decompress(rest[:_CHUNK], most)
                rest = rest[_CHUNK:]
            size += len(piece)
            if size > bound:
                raise ExpandsTooFar(bound)
            pieces.append(piece)
        rest = memoryview(inflater.unused_data + bytes(rest))
    return b"".join(pieces)


def _entries(text: str, *, tensors: int, source: str) -> list[Any]:
    """The JSON array ``text``, read one entry at a time and refused once it holds more than
    ``tensors`` (or nests too deep), so no more is built than the count allows."""
    decoder = json.JSONDecoder()
    index = _skip_space(text, 0)
    if not text.startswith("[", index):
        raise RefitInfoError(f"{source} holds no list of tensors, refitInfo.tensors says {tensors}")
    entries: list[Any] = []
    try:
        index = _skip_space(text, index + 1)
        while not text.startswith("]", index) and len(entries) <= tensors:
            if entries:
                if not text.startswith(",", index):
                    raise ValueError(f"expected ',' or ']' at character {index}")
                index = _skip_space(text, index + 1)
            entry, index = decoder.raw_decode(text, index)
            entries.append(entry)
            index = _skip_space(text, index)
        if len(entries) <= tensors and _skip_space(text, index + 1) != len(text):
            raise ValueError(f"extra data after the list at character {index + 1}")
    except (ValueError, RecursionError) as error:
        raise RefitInfoError(f"{source} is not gzip'd JSON: {error}") from None
    if len(entries) > tensors:
        raise RefitInfoError(f"{source} holds more than {tensors} tensors, refitInfo.tensors says {tensors}")
    if len(entries) != tensors:
        raise RefitInfoError(f"{source} holds {len(entries)} tensors, refitInfo.tensors says {tensors}")
    return entries


_SPACE = re.compile(r"[ \t\n\r]*")
"""JSON's whitespace."""


def _skip_space(text: str, index: int) -> int:
    """The index of the first character at or after ``index`` that is not JSON whitespace."""
    found = _SPACE.match(text, index)
    return found.end() if found is not None else index


async def accept(ctx: context.SessionContext) -> bool:
    """Check ``spec.refitInfo`` once; False once the session ended on it (a missing ConfigMap only
    waits: the trainer may write it after the spec)."""

    async def tensors() -> int:
        return len(await read(ctx.api, ctx.session))

    return await accept_counted(ctx, tensors)


async def accept_counted(ctx: context.SessionContext, tensors: Callable[[], Awaitable[int]]) -> bool:
    """Record what ``tensors()`` (a read of the session's refit info that counts its tensors) found:
    accepted, waiting while its ConfigMap is missing, or the session ended ``Broken`` on it (False)."""
    try:
        counted = await tensors()
    except RefitInfoError as error:
        if error.missing:
            await ctx.write(session_status.refit_info_waiting(ctx.session, str(error), conditions.now()))
            return True
        reason = session_status.REFIT_INFO_REJECTED
        await session_end.end(ctx.api, ctx.agents, ctx.session, phase="Broken", reason=reason, message=str(error))
        return False
    await ctx.write(session_status.refit_info_accepted(ctx.session, counted, conditions.now()))
    return True
