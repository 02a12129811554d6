"""Everything the chart renders, and the CRDs, validated strictly (an unknown field is an
error) against the Kubernetes 1.30 and 1.33 schemas, offline, with ``kubernetes-validate``.

EKS runs current versions; the 1.20 API server of the integration tests silently drops
fields it does not know, so it cannot catch a misspelt or misplaced key. Custom resources
(ServiceMonitor, cert-manager's Certificate and Issuer) have no schema in
``kubernetes-validate``: they are checked against their CRD's schema with ``jsonschema``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.chart.test_chart import ALL_ON, CERT_MANAGER, CHART, ROOT, TEST_CA, render

VERSIONS = ("1.30.0", "1.33.0")
CRD_DIR = ROOT / "scripts" / "sdc_harness" / "crds"
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "all-optional-parts": ALL_ON,
    "cert-manager": {**ALL_ON, **CERT_MANAGER},
    "cert-manager-issuer": {"certManager": {"enabled": True, "issuerRef": {"name": "corp"}}},
    "existing-secret": {"tls": {"existingSecret": "corp-tls", "caBundle": TEST_CA}},
    "no-webhook-no-tls": {"tls": {"enabled": False}, "webhook": {"enabled": False}},
}


@functools.cache  # parsing the CRDs' YAML (the PyTorchJob CRD is large) costs about 2 s
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the openAPIV3Schema of every CRD the tests know (read once per
    process: the CRD files do not change during a run, and nothing writes to the result)."""
    schemas = {}
    for path in [*CRD_DIR.glob("*.yaml"), *(ROOT / "crds").glob("*.yaml")]:
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schemas[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    return schemas


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The CRD's schema with unknown fields made errors, as the API server prunes them (a
    field a structural schema does not list is dropped, silently)."""
    schema = dict(schema)
    if schema.get("type") == "object" and "properties" in schema:
        schema.setdefault("additionalProperties", False)
        schema["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
    if isinstance(schema.get("items"), dict):
        schema["items"] = strict(schema["items"])
    return schema


def validate(doc: dict[str, Any], version: str) -> None:
    key = (doc["apiVersion"], doc["kind"])
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        schemas = crd_schemas()
        assert key in schemas, f"no schema for {key}: neither Kubernetes' nor a CRD's"
        body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
        jsonschema.validate(
            body,
            strict(
                {
                    **schemas[key],
                    "properties": {
                        k: v
                        for k, v in schemas[key].get("properties", {}).items()
                        if k not in ("apiVersion", "kind", "metadata")
                    },
                }
            ),
        )
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
            version,
            strict=True,
        )  # metadata is ObjectMeta for custom resources too


@pytest.mark.parametrize("version", VERSIONS)
def test_crds_validate_strictly(version: str) -> None:
    for path in sorted([*(ROOT / "crds").glob("*.yaml"), *(CHART / "crds").glob("*.yaml")]):
        for doc in yaml.safe_load_all(path.read_text()):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(
                    f"{path.relative_to(ROOT)}: {exc.message} at {list(exc.path)}"
                ) from None


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_chart_validates_strictly(variant: str, version: str) -> None:
    docs = render(VARIANTS[variant], hooks=True)
    assert docs
    for doc in docs:
        try:
            validate(doc, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            where = f"{doc['kind']} {doc['metadata'].get('name')}"
            raise AssertionError(f"{variant}: {where}: {exc.message} at {list(exc.path)}") from None


def test_strict_validation_catches_a_misplaced_field() -> None:
    """The check itself: a stray key, as line 121 of the SDCIncident CRD had one, fails."""
    (deploy,) = [d for d in render() if d["kind"] == "Deployment"]
    deploy["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="'resource' was unexpected"):
        validate(deploy, VERSIONS[0])
    crd = yaml.safe_load(Path(ROOT / "crds" / "hyperpod-sdc.dev_sdcincidents.yaml").read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    status["properties"]["resumedFrom"]["as the agent reported it."] = None
    with pytest.raises(kubernetes_validate.ValidationError, match="was unexpected"):
        kubernetes_validate.validate(crd, VERSIONS[0], strict=True)


def test_custom_resources_are_checked_against_their_crd() -> None:
    (serving, _) = sorted(
        (d for d in render(CERT_MANAGER) if d["kind"] == "Certificate"),
        key=lambda d: d["metadata"]["name"],
        reverse=True,
    )
    assert serving["metadata"]["name"].endswith("-tls")
    validate(serving, VERSIONS[0])
    serving["spec"]["dnsName"] = serving["spec"].pop("dnsNames")
    with pytest.raises(jsonschema.ValidationError, match="'dnsName' was unexpected"):
        validate(serving, VERSIONS[0])
