"""Kopf's bookkeeping on our objects, bounded and tolerant.

Installed by :mod:`megafleet.handlers`. Three things Kopf does by default break a fleet:

* it keeps the whole last-handled spec in one annotation, and annotations are limited to 256 KiB
  in all: a valid spec of ~330 KB could be created but never updated or deleted;
* a malformed annotation of its own (edited by hand, truncated, or nested past the JSON parser's
  depth) raises ``JSONDecodeError`` (or ``RecursionError``) on every event, so the object is never
  reconciled again;
* every object with a timer or daemon gets a finalizer, so deleting a fleet, a Refit or their
  namespace hangs for as long as no operator runs.

:class:`DigestDiffBase` stores one SHA-256 per top-level part instead (Kopf only needs to see that
the spec changed: every trigger runs the same level-based reconcile), and both storages read a
malformed record as none (the object is then handled as new, and the record rewritten).
:func:`without_finalizers` drops the finalizer of the spawning handlers; they are daemons that end by
themselves once their object is gone, since without a finalizer Kopf cannot stop them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Collection, Iterable
from typing import Any, cast

import kopf

log = logging.getLogger(__name__)


class DigestDiffBase(kopf.AnnotationsDiffBaseStorage):
    """The last-handled configuration as ``{part: {"sha256": ...}}``: a few hundred bytes whatever the
    size of the spec, labels or annotations; a change in a part still shows as a change of it.

    With ``group``, only objects of that API group (the operator's own kinds, the only ones with
    change handlers and daemons, which alone use the essence) get one: Kopf builds an essence for
    every event of every watched resource, and for pods, which the operator only indexes and
    watches, that was a deep copy and a sorted JSON dump of each pod event's spec for nothing
    (~10 % of the operator's CPU with 1,000 pods starting)."""

    def __init__(self, *, prefix: str, key: str, group: str | None = None) -> None:
        super().__init__(prefix=prefix, key=key)
        self.group = group

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        if self.group is not None and not str(body.get("apiVersion", "")).startswith(f"{self.group}/"):
            return cast(kopf.BodyEssence, {})
        if not extra_fields:  # the essence never holds the status: Kopf need not deep-copy it
            body = _without_status(body)
        essence = super().build(body=body, extra_fields=extra_fields)
        return cast(kopf.BodyEssence, {key: {"sha256": _digest(value)} for key, value in essence.items()})

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        try:
            found = super().fetch(body=body)
        except (ValueError, RecursionError) as error:  # not JSON, or nested past the parser's depth
            log.warning("ignoring a malformed last-handled configuration of %s: %s", body.metadata.name, error)
            return None
        return found if isinstance(found, dict) else None


class TolerantProgress(kopf.AnnotationsProgressStorage):
    """Kopf's per-handler progress annotations, a malformed one read as no progress."""

    def fetch(self, *, key: Any, body: kopf.Body) -> kopf.ProgressRecord | None:
        try:
            found = super().fetch(key=key, body=body)
        except (ValueError, RecursionError) as error:
            log.warning("ignoring a malformed progress record of %s: %s", body.metadata.name, error)
            return None
        return found if isinstance(found, dict) else None


_KEPT_METADATA = ("name", "namespace", "uid", "labels", "annotations")
"""What of ``metadata`` the essence or its storage keys may read (Kopf keeps labels and annotations)."""


def _without_status(body: kopf.Body) -> kopf.Body:
    """``body`` without what Kopf's essence drops anyway: ``status`` and the system metadata
    (``managedFields`` above all). Kopf deep-copies the whole body before dropping them, on every
    event of every fleet; a fleet's status and managed fields are most of it."""
    slim = {key: value for key, value in body.items() if key != "status"}
    slim["metadata"] = {key: value for key, value in body.get("metadata", {}).items() if key in _KEPT_METADATA}
    return kopf.Body(cast(kopf.RawBody, slim))


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def without_finalizers(registry: kopf.OperatorRegistry) -> None:
    """Let objects with daemons go without an operator: no finalizer for the spawning handlers.

    Kopf has no public switch for it (1.45): its handlers are frozen dataclasses in the registry,
    replaced here by copies. Only daemons that return once their object is gone may be registered
    so (:func:`megafleet.handlers.poll`), or their tasks would outlive the objects.
    """
    spawning = registry._spawning
    handlers: Collection[Any] = spawning.get_all_handlers()
    spawning._handlers = [dataclasses.replace(handler, requires_finalizer=False) for handler in handlers]
