"""NeMo's M-to-N reshard refit info as the operator reads it: from the session's ConfigMap, checked.

NeMo RL's ``prepare_nccl_reshard_refit_info`` (its wire-safe form, written by
:mod:`megafleet.sdk.nemo.reshard_info`) is a gzip'd JSON object (``layer_names``, ``per_layer_params``,
``misc_meta``, the world sizes) under the ConfigMap key ``spec.nemoReshard.refitInfo`` names, with its
sha256 and the count of its tensors (bulk and misc). The RefitSession controller checks it once
(:func:`accept`: ``RefitInfoAccepted``, or the session ``Broken``, ``RefitInfoRejected``); each Refit
through the session reads it again for the members' request (:func:`read`, from :mod:`.session_refits`),
which parse it whole (the engines, which import torch; the operator does not).

The same guards as the collective's refit info (:mod:`.refit_info_check`): the gzip is inflated a piece
at a time up to :data:`ENTRY_BYTES` per counted tensor (a bulk entry carries two rank meshes), the JSON
nests no deeper than Python parses, and the tensors must be exactly as many as counted.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Mapping
from typing import Any

from megafleet import kube
from megafleet.refits import context, refit_info_check, session_view

ENTRY_BYTES = 16 * 1024
"""The room each counted tensor gets once inflated: a bulk entry's name, shape, dtype and two rank
meshes (a mesh of 1,024 inference ranks is about 6 KB)."""

RefitInfoError = refit_info_check.RefitInfoError


async def read(api: kube.Api, session: session_view.Session) -> dict[str, Any]:
    """NeMo's reshard refit info from the session's ConfigMap, checked against ``sha256`` and
    ``tensors``. Raises :class:`RefitInfoError` (``missing`` while it is not written yet)."""
    reshard = session.spec.nemo_reshard
    ref = reshard.refit_info if reshard is not None else None
    if ref is None:
        raise RefitInfoError(f"RefitSession {session.name} has no nemoReshard.refitInfo yet", missing=True)
    data, source = await refit_info_check.packed(api, session.namespace, ref)
    return parse(data, sha256=ref.sha256, tensors=ref.tensors, source=source)


def parse(packed: bytes, *, sha256: str, tensors: int, source: str) -> dict[str, Any]:
    """The reshard refit info in ``packed`` (gzip'd JSON), checked; :class:`RefitInfoError` names what is wrong."""
    digest = hashlib.sha256(packed).hexdigest()
    if digest != sha256:
        raise RefitInfoError(f"{source}: sha256 {digest} is not refitInfo.sha256 {sha256}")
    bound = min(refit_info_check.MAX_EXPANDED_BYTES, max(tensors, 1) * ENTRY_BYTES)
    try:
        found = json.loads(refit_info_check.gunzip(packed, bound=bound))
    except refit_info_check.ExpandsTooFar:
        raise RefitInfoError(
            f"{source} expands past {bound} bytes ({len(packed)} gzip'd), more than refitInfo.tensors {tensors} "
            "entries can take: refused unread (a decompression bomb?)"
        ) from None
    except (OSError, EOFError, ValueError, RecursionError, zlib.error) as error:
        raise RefitInfoError(f"{source} is not gzip'd JSON: {error}") from None
    counted = count(found)
    if counted is None:
        raise RefitInfoError(
            f"{source} is not NeMo's reshard refit info (an object with layer_names, per_layer_params and misc_meta)"
        )
    if counted != tensors:
        raise RefitInfoError(f"{source} holds {counted} tensors, refitInfo.tensors says {tensors}")
    return dict(found)


def count(info: Any) -> int | None:
    """How many tensors NeMo's reshard refit info names (every layer's bulk entries and the misc ones),
    or None when it is not shaped as one (each layer named in ``layer_names`` has a list of entries)."""
    if not isinstance(info, Mapping):
        return None
    layers, per_layer, misc = info.get("layer_names"), info.get("per_layer_params"), info.get("misc_meta", {})
    if not isinstance(layers, list) or not isinstance(per_layer, Mapping) or not isinstance(misc, Mapping):
        return None
    entries = [per_layer.get(layer) for layer in layers if isinstance(layer, str)]
    if len(entries) != len(layers) or not all(isinstance(entry, list) for entry in entries):
        return None
    return sum(len(entry) for entry in entries if isinstance(entry, list)) + len(misc)


async def accept(ctx: context.SessionContext) -> bool:
    """Check ``spec.nemoReshard.refitInfo`` once; False once the session ended on it (a missing
    ConfigMap only waits: the trainer may write it after the spec)."""

    async def tensors() -> int:
        reshard = ctx.session.spec.nemo_reshard
        await read(ctx.api, ctx.session)  # raises unless it exists and holds as many tensors as counted
        assert reshard is not None and reshard.refit_info is not None
        return reshard.refit_info.tensors

    return await refit_info_check.accept_counted(ctx, tensors)
