"""The API models: generated files in sync, Kubernetes API conventions, operator-side checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from megafleet.api import checks, crd, generate, v1alpha1

ROOT = Path(__file__).resolve().parents[2]
INVALID = sorted((ROOT / "tests" / "e2e" / "invalid").glob("*.yaml"))
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_generated_files_match_the_models() -> None:
    stale = generate.stale_files(ROOT)
    assert stale == [], f"run `megafleet crds`: {stale}"


def walk(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = [(path, schema)]
    for name, sub in schema.get("properties", {}).items():
        found += walk(sub, f"{path}.{name}")
    if "items" in schema:
        found += walk(schema["items"], f"{path}[]")
    return found


@pytest.mark.parametrize("info", v1alpha1.KINDS, ids=[k.kind for k in v1alpha1.KINDS])
def test_schema_follows_api_conventions(info: v1alpha1.KindInfo) -> None:
    for part in ("spec", "status"):
        for path, node in walk(
            crd.definition(info)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][part]
        ):
            assert node.get("type") != "number", f"{part}{path}: no floats in the API"
            assert "type" in node, f"{part}{path}: structural schemas need a type"
            name = path.rsplit(".", 1)[-1].rstrip("[]")
            if path and not path.endswith("[]"):
                description = node.get("description", "")
                assert description.split(" ")[0].rstrip(",:.") == name, (
                    f"{part}{path}: description must start with {name!r}"
                )


def test_crd_registers_scale_status_short_names_and_columns() -> None:
    definition = crd.definition(v1alpha1.KINDS[0])
    version = definition["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert "status" in version["subresources"]
    assert definition["spec"]["names"]["shortNames"] == ["mgen"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Desired", "Ready", "Weights", "Status", "Age"]
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(path.read_text())
    return document


SPECS: dict[str, type[v1alpha1.ApiModel]] = {info.kind: info.spec for info in v1alpha1.KINDS}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_pass_operator_checks(path: Path) -> None:
    manifest = load(path)
    if manifest["kind"] != "MegatronGeneration":
        SPECS[manifest["kind"]].model_validate(manifest["spec"])
        return
    spec, problems = checks.parse_spec(manifest["spec"], name=manifest["metadata"]["name"])
    assert spec is not None and problems == []


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_operator_rejects_what_admission_rejects(path: Path) -> None:
    """If an object bypassed admission (older CRD), the operator still reports it as InvalidSpec."""
    manifest = load(path)
    field = next(line.split(": ", 1)[1] for line in path.read_text().splitlines() if line.startswith("# field:"))
    if manifest["kind"] != "MegatronGeneration":
        with pytest.raises(ValueError):
            SPECS[manifest["kind"]].model_validate(manifest["spec"])
        return
    _, problems = checks.parse_spec(manifest["spec"], name=manifest["metadata"]["name"])
    assert problems, "no problem reported"
    assert any(problem.field.startswith(field) or field.startswith(problem.field) for problem in problems), problems


def test_a_fleet_shows_an_unobserved_generation_before_the_operator_writes_status() -> None:
    """kstatus (Flux's health check) takes an object without status for Current: the schema's default
    makes a new fleet read as generation 1 of which 0 is observed, in progress."""
    definition = crd.definition(v1alpha1.KINDS[0])
    status = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["default"] == {"observedGeneration": 0}
    assert "observedGeneration" in status["properties"]


def test_a_fleet_without_refit_settings_keeps_its_sequences_and_stages_and_its_crd_says_so() -> None:
    """The refit defaults (proposal 0003, step 10): in flight keep, staging auto; integrity and commit
    stay none and local (the digest's GPU cost is unmeasured). The API server fills the same values in:
    the CRD's default for spec.refit and for each field."""
    spec = v1alpha1.MegatronGenerationSpec.model_validate({"model": {"source": "/m"}})
    refit = crd.definition(v1alpha1.KINDS[0])["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["refit"]
    expected = {"inFlight": "keep", "staging": "auto", "integrity": "none", "commit": "local"}

    assert (spec.refit.in_flight, spec.refit.staging, spec.refit.integrity, spec.refit.commit) == tuple(
        expected.values()
    )
    assert {key: refit["default"][key] for key in expected} == expected
    assert {key: refit["properties"][key]["default"] for key in expected} == expected


def test_keep_with_offload_is_admitted_on_either_backend() -> None:
    """keep is the default, so a fleet whose engines cannot keep under its KV mode (offload on the
    transformers backend) is not refused: its Refits drain and say KeepUnavailable."""
    definition = crd.definition(v1alpha1.KINDS[0])
    rules = definition["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"
    ]
    raw = {
        "model": {"source": "/m"},
        "resources": {"gpusPerNode": 1},
        "engine": {"backend": "transformers", "kvCacheMode": "offload"},
        "refit": {"inFlight": "keep"},
    }

    assert not [rule for rule in rules if "inFlight" in rule["rule"]]
    assert checks.parse_spec(raw, name="f")[1] == []
