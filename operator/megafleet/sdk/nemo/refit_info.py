"""NeMo RL's refit info (``policy.prepare_refit_info()``, ``{name: (shape, dtype)}`` in the wire's
order) as the fleet reads it: gzip'd JSON ``[[name, shape, dtype], ...]`` in an immutable ConfigMap
owned by the RefitSession, named by the session's ``spec.refitInfo`` with its sha256 and count
(proposal 0001, section 1).

NeMo's M-to-N reshard refit info (``prepare_nccl_reshard_refit_info``, its wire-safe JSON object) is
stored the same way (:func:`encode_reshard`), named by ``spec.nemoReshard.refitInfo``; its count is
its bulk and misc tensors.

Called by :class:`~megafleet.sdk.nemo.refit_wire_nemo.NemoWire`. Pure: the gzip is deterministic
(no timestamp), so the same info always has the same sha256.
"""

from __future__ import annotations

import base64
import dataclasses
import gzip
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from megafleet.api import v1alpha1

__all__ = ["KEY", "MAX_GZIPPED_BYTES", "Encoded", "config_map", "decode", "encode", "encode_reshard", "reference"]

KEY = "refitInfo.json.gz"
"""The ConfigMap's key (binaryData)."""
MAX_GZIPPED_BYTES = 1024 * 1024
"""The largest refit info stored: well under etcd's 1.5 MiB object limit (a 235B MoE is ~300 KB)."""


@dataclasses.dataclass(frozen=True)
class Encoded:
    """The refit info as stored: the gzip'd bytes, their sha256 and the number of tensors."""

    gzipped: bytes
    sha256: str
    tensors: int


def encode(state_dict_info: Mapping[str, Any]) -> Encoded:
    """``{name: (shape, dtype)}`` (dtype a ``torch.dtype`` or its name) in the mapping's order.

    Raises:
        ValueError: no tensors, an entry that is not ``(shape, dtype)``, or more than
            :data:`MAX_GZIPPED_BYTES` gzip'd (naming the count).
    """
    if not state_dict_info:
        raise ValueError("prepare_refit_info got no tensors: the trainer's refit info is empty")
    entries = []
    for name, value in state_dict_info.items():
        try:
            shape, dtype = value[0], value[1]
            entries.append([str(name), [int(size) for size in shape], str(dtype).removeprefix("torch.")])
        except (TypeError, IndexError, ValueError) as error:
            raise ValueError(f"refit info entry {name!r} is not (shape, dtype): {value!r} ({error})") from None
    text = json.dumps(entries, separators=(",", ":")).encode()
    gzipped = gzip.compress(text, compresslevel=9, mtime=0)
    if len(gzipped) > MAX_GZIPPED_BYTES:
        raise ValueError(
            f"the trainer's refit info lists {len(entries)} tensors, {len(gzipped)} bytes gzip'd: more than the "
            f"{MAX_GZIPPED_BYTES} bytes a RefitSession's ConfigMap may hold"
        )
    return Encoded(gzipped, hashlib.sha256(gzipped).hexdigest(), len(entries))


def encode_reshard(info: Mapping[str, Any]) -> Encoded:
    """NeMo's wire-safe reshard refit info, as it is (its tensors: every layer's bulk entries and the
    misc ones, in order).

    Raises:
        ValueError: not JSON (NeMo's wire-safe form is), or more than :data:`MAX_GZIPPED_BYTES` gzip'd.
    """
    try:
        text = json.dumps(info, separators=(",", ":")).encode()
    except (TypeError, ValueError) as error:
        raise ValueError(f"NeMo's reshard refit info is not its wire-safe form (plain JSON): {error}") from None
    per_layer = info.get("per_layer_params") or {}
    tensors = sum(len(per_layer[layer]) for layer in info.get("layer_names") or ()) + len(info.get("misc_meta") or {})
    gzipped = gzip.compress(text, compresslevel=9, mtime=0)
    if len(gzipped) > MAX_GZIPPED_BYTES:
        raise ValueError(
            f"NeMo's reshard refit info names {tensors} tensors, {len(gzipped)} bytes gzip'd: more than the "
            f"{MAX_GZIPPED_BYTES} bytes a RefitSession's ConfigMap may hold"
        )
    return Encoded(gzipped, hashlib.sha256(gzipped).hexdigest(), tensors)


def decode(gzipped: bytes) -> list[tuple[str, list[int], str]]:
    """What :func:`encode` stored, as ``(name, shape, dtype name)`` in order (for tests and tools)."""
    return [(name, list(shape), dtype) for name, shape, dtype in json.loads(gzip.decompress(gzipped))]


def config_map(name: str, namespace: str, encoded: Encoded, owner: Mapping[str, Any]) -> dict[str, Any]:
    """The immutable ConfigMap holding ``encoded``, owned by the RefitSession ``owner`` (its object)."""
    metadata = owner["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "ownerReferences": [
                {
                    "apiVersion": v1alpha1.API_VERSION,
                    "kind": "RefitSession",
                    "name": metadata["name"],
                    "uid": metadata["uid"],
                }
            ],
        },
        "immutable": True,
        "binaryData": {KEY: base64.b64encode(encoded.gzipped).decode()},
    }


def reference(config_map_name: str, encoded: Encoded) -> v1alpha1.RefitInfoRef:
    """The session's ``spec.refitInfo`` for ``encoded`` stored in ``config_map_name``."""
    return v1alpha1.RefitInfoRef(
        config_map_ref=v1alpha1.ConfigMapKeyRef(name=config_map_name, key=KEY),
        sha256=encoded.sha256,
        tensors=encoded.tensors,
    )
