"""What the adapter hands to NeMo RL's ``ray.get``: Ray object refs when Ray runs in this process,
else plain values (so a driver without Ray, and the unit tests, read ``list[bool]``).

Called by every adapter method NeMo RL passes to ``ray.get``. Ray is looked up in ``sys.modules``,
never imported: a process that did not import it has no Ray to use (import-linter keeps it so).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["ObjectRef", "ObjectRefs", "object_refs"]

ObjectRefs = list[Any]
"""``list[ray.ObjectRef]`` (each resolving to ``True``) when Ray is initialised here, else ``list[bool]``."""
ObjectRef = Any
"""One ``ray.ObjectRef`` when Ray is initialised here, else a ``bool``."""


def object_refs(values: list[bool]) -> ObjectRefs:
    """``values`` as Ray object refs when Ray is initialised in this process, else as they are."""
    ray: Any = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return [ray.put(value) for value in values]
    return list(values)
