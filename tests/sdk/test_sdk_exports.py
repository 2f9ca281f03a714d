"""The SDK's public names, fixed: what an RL job imports from ``megafleet.sdk`` and
``megafleet.sdk.nemo`` (NeMo RL configs name these paths). ``megafleet.sdk`` resolves its names on
first use (a module ``__getattr__``, so importing it loads no torch); its ``TYPE_CHECKING`` imports
are what type checkers see, and every name must resolve at run time to the same object."""

from __future__ import annotations

import ast
import importlib
import inspect
import types

import pytest

import megafleet.sdk
import megafleet.sdk.nemo

SDK_NAMES = [
    "Answer",
    "Attempt",
    "CommitMode",
    "Fleet",
    "FleetError",
    "FleetNotFound",
    "FleetNotReady",
    "FleetState",
    "Frontend",
    "GenerationFailed",
    "Generator",
    "InFlightMode",
    "KvCacheMode",
    "MegafleetGeneration",
    "NoFrontend",
    "ReceiverFailed",
    "RefitError",
    "RefitFailed",
    "RefitRejected",
    "RefitResult",
    "RefitTimeout",
    "Router",
    "Sampling",
    "SendReport",
    "StagingMode",
    "VersionSpan",
    "WeightSender",
    "attempt_port",
]
NEMO_NAMES = [
    "CollectiveSenderSpec",
    "Handle",
    "MegafleetGeneration",
    "check_right_padding",
    "nemo_factory",
    "pack_outputs",
]


def type_checking_homes() -> dict[str, str]:
    """name -> module of the ``if TYPE_CHECKING:`` imports of ``megafleet/sdk/__init__.py``."""
    tree = ast.parse(inspect.getsource(megafleet.sdk))
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    return {
        alias.asname or alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names
    }


@pytest.mark.parametrize("module, names", [(megafleet.sdk, SDK_NAMES), (megafleet.sdk.nemo, NEMO_NAMES)])
def test_the_public_names_are_fixed_and_sorted(module: types.ModuleType, names: list[str]) -> None:
    assert module.__all__ == names  # a change here changes what RL jobs may import
    assert names == sorted(names)


def test_every_public_name_resolves_to_the_object_type_checkers_see() -> None:
    homes = type_checking_homes()
    assert sorted(homes) == SDK_NAMES  # nothing public is unseen by type checkers, nothing seen is private
    for name, home in homes.items():
        assert getattr(megafleet.sdk, name) is getattr(importlib.import_module(home), name), name
    for name in NEMO_NAMES:
        assert getattr(megafleet.sdk.nemo, name) is not None


def test_a_name_that_is_not_public_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'FIELD_MANAGER'"):
        megafleet.sdk.FIELD_MANAGER  # noqa: B018
    assert not hasattr(megafleet.sdk, "routable")
