"""The operator's garbage-collector settings (:func:`megafleet.operator_main._tune_garbage_collector`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from megafleet import operator_main


@pytest.fixture
def restored_gc() -> Iterator[None]:
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("restored_gc")
def test_collections_are_rarer_and_the_imported_modules_are_out_of_them() -> None:
    gc.unfreeze()
    operator_main._tune_garbage_collector()
    assert gc.get_threshold() == operator_main.GC_THRESHOLDS
    assert operator_main.GC_THRESHOLDS[0] > 700  # Python's default would be left
    assert gc.get_freeze_count() > 10_000  # the modules imported so far (Kopf, lightkube, pydantic, ...)
