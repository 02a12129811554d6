"""The SDCIncident CRD: the names users see, a structural schema, and printer columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "hyperpod-sdc.dev_sdcincidents.yaml"


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def test_names(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "sdcincidents.hyperpod-sdc.dev"
    assert (spec["group"], spec["scope"]) == ("hyperpod-sdc.dev", "Namespaced")
    assert spec["names"]["kind"] == "SDCIncident"
    assert spec["names"]["shortNames"] == ["sdci"]
    assert spec["names"]["categories"] == ["sdc"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    columns = [c["name"].upper() for c in version["additionalPrinterColumns"]]
    assert columns == [
        "JOB",
        "CHECK",
        "NODE",
        "INSTANCE",
        "RANK",
        "STEP",
        "PHASE",
        "CONFIRMED",
        "LOST",
        "AGE",
    ]


def _walk(schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths where the schema is not structural (every node needs a type)."""
    bad = [] if "type" in schema else [path or "<root>"]
    for name, sub in (schema.get("properties") or {}).items():
        bad += _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        bad += _walk(schema["items"], f"{path}[]")
    return bad


def test_schema_is_structural_and_needs_nothing_newer_than_1_20(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []
    assert "x-kubernetes-validations" not in CRD_PATH.read_text()


def test_an_incident_validates(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    incident: dict[str, Any] = {
        "apiVersion": "hyperpod-sdc.dev/v1alpha1",
        "kind": "SDCIncident",
        "metadata": {"name": "llama-train-1150-1200", "namespace": "team"},
        "spec": {
            "job": {
                "apiVersion": "kubeflow.org/v1",
                "kind": "PyTorchJob",
                "name": "llama-train",
                "uid": "6c1f",
            },
            "check": "replay",
            "classification": "rank",
            "detectionStep": 1200,
            "lastCleanStep": 1150,
            "transient": False,
        },
        "status": {
            "phase": "Contained",
            "node": "hyperpod-i-0123456789abcdef0",
            "instanceId": "i-0123456789abcdef0",
            "ranks": "3",
            "suspects": [
                {
                    "rank": 3,
                    "localRank": 1,
                    "pod": "llama-train-worker-1",
                    "node": "hyperpod-i-0123456789abcdef0",
                    "instanceId": "i-0123456789abcdef0",
                }
            ],
            "conditions": [{"type": "Detected", "status": "True", "reason": "Agreement"}],
        },
    }
    jsonschema.Draft7Validator(schema).validate(incident)
    broken = {**incident, "spec": {**incident["spec"], "check": "vibes"}}
    assert not jsonschema.Draft7Validator(schema).is_valid(broken)


POLICY_CRD = CRD_PATH.parent / "hyperpod-sdc.dev_sdcpolicies.yaml"


def test_the_policy_crd_is_cluster_scoped_structural_and_validates() -> None:
    crd = yaml.safe_load(POLICY_CRD.read_text())
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "sdcpolicies.hyperpod-sdc.dev"
    assert (spec["group"], spec["scope"], spec["names"]["kind"]) == (
        "hyperpod-sdc.dev",
        "Cluster",
        "SDCPolicy",
    )
    assert spec["names"]["shortNames"] == ["sdcp"]
    (version,) = spec["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []
    assert "x-kubernetes-validations" not in POLICY_CRD.read_text()
    good = {
        "apiVersion": "hyperpod-sdc.dev/v1alpha1",
        "kind": "SDCPolicy",
        "metadata": {"name": "ml"},
        "spec": {
            "namespaces": ["ml"],
            "namespaceSelector": {
                "matchExpressions": [{"key": "team", "operator": "In", "values": ["ml"]}]
            },
            "remediationPolicy": "auto-reboot",
            "dryRun": True,
        },
    }
    jsonschema.validate(good, schema)
    bad = {**good, "spec": {"remediationPolicy": "auto-delete"}}
    with pytest.raises(jsonschema.ValidationError, match="auto-delete"):
        jsonschema.validate(bad, schema)
