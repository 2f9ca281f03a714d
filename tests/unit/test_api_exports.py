"""The versioned API's public names: ``megafleet.api.v1alpha1.__all__`` is complete and sorted.

Callers import the package and qualify (``v1alpha1.RefitObjectSpec``); the package re-exports the
public names of its modules (one per kind, plus the shared types). A name imported into the package
but left out of ``__all__``, a model a module defines but the package does not export, or a kind
missing from ``KINDS`` fails here.
"""

from __future__ import annotations

import types

from megafleet.api import v1alpha1
from megafleet.api.v1alpha1 import (
    common,
    fleet_engine,
    fleet_placement,
    fleet_pod,
    fleet_status,
    megatron_generation,
    refit,
    refit_report,
    refit_session,
)

MODULES = (
    common,
    fleet_engine,
    fleet_placement,
    fleet_pod,
    fleet_status,
    megatron_generation,
    refit,
    refit_report,
    refit_session,
)


def ruff_order(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps ``__all__`` in: constants, then classes, then functions."""
    if name.isupper():
        return 0, name
    return (1 if name[0].isupper() else 2), name


def test_all_lists_every_public_name_sorted() -> None:
    public = [
        name
        for name, value in vars(v1alpha1).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    ]
    assert v1alpha1.__all__ == sorted(public, key=ruff_order)


def test_every_model_of_the_modules_is_exported() -> None:
    for module in MODULES:
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__ and not name.startswith("_"):
                assert name in v1alpha1.__all__, f"{module.__name__}.{name}"
                assert getattr(v1alpha1, name) is value


def test_kinds_lists_each_kind_module_once() -> None:
    assert v1alpha1.KINDS == (megatron_generation.KIND, refit.KIND, refit_session.KIND)
    assert [info.kind for info in v1alpha1.KINDS] == ["MegatronGeneration", "Refit", "RefitSession"]
