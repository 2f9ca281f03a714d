"""Decode Kopf's watch streams with msgspec instead of the standard library's ``json``.

Installed by :func:`megafleet.operator_main.run` before Kopf starts. Kopf decodes every line of every
watch stream with ``json.loads``; a fleet's pod events are ~10 KB of nested objects (their managed
fields most of it), and at 1,000 pods that decoding was the operator's largest single cost: 2.0 CPU
seconds of ~19 for 3,800 events (35 MB) in ``bench/controlplane.py``. msgspec builds the same plain
dicts, lists and scalars several times faster. Only Kopf's stream module is changed; every other
``json`` user is untouched.
"""

from __future__ import annotations

import json
import logging
import types

import msgspec
from kopf._cogs.clients import api as kopf_api

__all__ = ["install"]

log = logging.getLogger(__name__)

_DECODER = msgspec.json.Decoder()


def loads(text: str | bytes) -> object:
    """``json.loads`` for one watch-stream line: the same Python objects, decoded by msgspec."""
    return _DECODER.decode(text)


def install() -> bool:
    """Point Kopf's stream module at :func:`loads` (once). False, with a warning, when this Kopf's
    module does not decode through a module-level ``json`` (then it is left as it is)."""
    current = getattr(kopf_api, "json", None)
    if isinstance(current, types.SimpleNamespace) and current.loads is loads:
        return True
    if current is not json:
        log.warning("Kopf's API module does not use the json module: its watch decoding is left as it is")
        return False
    kopf_api.json = types.SimpleNamespace(loads=loads, dumps=json.dumps)  # type: ignore[assignment,attr-defined]
    return True
