"""The refit tests' Refit builder (:func:`helpers.refit_e2e.refit_manifest`, shared by the e2e,
chaos and soak tests) writes what the API accepts, for both sources."""

from __future__ import annotations

import pytest

from helpers import refit_e2e
from megafleet.api import v1alpha1


def test_a_rendezvous_refit_names_the_trainer_and_validates() -> None:
    manifest = refit_e2e.refit_manifest("tiny", 3, port=29600)
    assert manifest["metadata"]["name"] == "tiny-v3"
    spec = v1alpha1.RefitObjectSpec.model_validate(manifest["spec"])
    assert spec.version == 3 and spec.fleet_ref.name == "tiny"
    rendezvous = manifest["spec"]["source"]["rendezvous"]
    assert rendezvous == {"address": refit_e2e.TRAINER_ADDRESS, "port": 29600, "trainerWorldSize": 1}


def test_a_checkpoint_refit_validates_and_one_source_is_required() -> None:
    manifest = refit_e2e.refit_manifest("tiny", 1, checkpoint="tiny://llama?seed=7")
    v1alpha1.RefitObjectSpec.model_validate(manifest["spec"])
    assert manifest["spec"]["source"] == {"checkpoint": {"path": "tiny://llama?seed=7"}}
    with pytest.raises(ValueError, match="exactly one source"):
        refit_e2e.refit_manifest("tiny", 1)
    with pytest.raises(ValueError, match="exactly one source"):
        refit_e2e.refit_manifest("tiny", 1, port=1, checkpoint="x")
