"""The Helm chart, rendered offline with Helm v4 (helm-python-sdk): values, schema, lint,
and what the templates produce. tests/integration/test_install.py creates the rendered
manifests on a real API server."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "hyperpod-sdc"
ALL_ON: dict[str, Any] = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "networkPolicy": {
        "enabled": True,
        "namespaceSelector": {"matchLabels": {"team": "ml"}},
        "webhookFrom": [{"ipBlock": {"cidr": "10.0.0.0/16"}}],
    },
    "webhook": {
        "failurePolicy": "Fail",
        "containers": ["pytorch"],
        "namespaceSelector": {"matchLabels": {"team": "ml"}},
    },
    "operator": {"namespaces": ["ml"], "dryRun": True, "clusterName": "ml-cluster"},
    "serviceAccount": {
        "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/sdc"}
    },
    "policy": {
        "create": True,
        "name": "ml-teams",
        "namespaces": ["ml"],
        "namespaceSelector": {"matchLabels": {"team": "ml"}},
    },
}


TEST_CA = (
    "-----BEGIN CERTIFICATE-----\n"
    "MIIBdzCCAR2gAwIBAgIUZm9yIHRlc3RzIG9ubHkgMDAwMDAwMAoGCCqGSM49BAMC\n"
    "-----END CERTIFICATE-----\n"
)
CERT_MANAGER: dict[str, Any] = {"certManager": {"enabled": True}}


def render(
    values: dict[str, Any] | None = None, namespace: str = "hyperpod-sdc", *, hooks: bool = False
) -> list[dict[str, Any]]:
    """Every object the chart renders (templates only; Helm installs crds/ itself); the
    uninstall hook's objects, which exist only while it runs, with ``hooks``."""
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values or {}, name="hyperpod-sdc", namespace=namespace, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d and (hooks or hook(d) is None)]
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_crd_is_an_identical_copy() -> None:
    for source in (ROOT / "crds").glob("*.yaml"):
        copy = CHART / "crds" / source.name
        assert copy.read_bytes() == source.read_bytes(), (
            f"{copy} differs from {source}: cp crds/*.yaml {copy.parent}/"
        )
    assert sorted(p.name for p in (CHART / "crds").glob("*")) == sorted(
        p.name for p in (ROOT / "crds").glob("*.yaml")
    )


def test_every_value_has_a_comment() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z][\w.-]*:", line):
            above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            if not above.startswith("# --"):
                uncommented.append(line.strip())
    assert not uncommented, f"values.yaml keys without a '# --' comment: {uncommented}"


def test_schema_covers_every_value_and_rejects_unknown_keys() -> None:
    chart = helm.Chart.load(str(CHART))
    chart.validate_schema({})
    chart.validate_schema(ALL_ON)
    typos: list[tuple[dict[str, Any], str]] = [
        ({"operatr": {}}, "operatr"),
        ({"tls": {"enabeld": True}}, "enabeld"),
        ({"image": {"tags": "1"}}, "tags"),
    ]
    for typo, where in typos:
        with pytest.raises(helm.HelmValuesError, match=where):
            chart.render(typo, name="x", namespace="x")
    with pytest.raises(helm.HelmValuesError, match="agreementNodes"):
        chart.render({"operator": {"agreementNodes": 0}}, name="x", namespace="x")


def test_lint_is_clean() -> None:
    for values in ({}, ALL_ON):
        report = helm.lint(str(CHART), values, strict=True)
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not report["errors"] and not problems, report


def hook(doc: dict[str, Any]) -> str | None:
    return ((doc.get("metadata") or {}).get("annotations") or {}).get("helm.sh/hook")


def test_default_render_is_least_privilege_and_hardened() -> None:
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "MutatingWebhookConfiguration",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "Secret",
        "Service",
        "Service",
        "Service",
        "ServiceAccount",
        "ValidatingWebhookConfiguration",
    ]
    (deploy,) = by_kind(docs, "Deployment")
    spec = deploy["spec"]
    # two replicas, and an update that never leaves none serving
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert container["resources"]["requests"] and container["resources"]["limits"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HYPERPOD_SDC_TLS_CERT_FILE"] == "/etc/hyperpod-sdc/tls/tls.crt"
    assert (env["HYPERPOD_SDC_DRY_RUN"], env["HYPERPOD_SDC_AGREEMENT_NODES"]) == ("false", "2")
    (role,) = by_kind(docs, "ClusterRole")
    for rule in role["rules"]:
        assert "secrets" not in rule["resources"] and "*" not in rule["resources"] + rule["verbs"]
        assert "deletecollection" not in rule["verbs"]
        if "configmaps" in rule["resources"] and rule["verbs"] != ["create"]:
            assert rule["resourceNames"] == ["hyperpod-sdc-ca"]
        if "delete" in rule["verbs"]:
            # retention deletes its own incidents; a confirmation pod that did not start
            # is deleted (pods: create and delete only where confirmation is on)
            assert rule["resources"] in (["sdcincidents"], ["pods"])
        if rule["resources"] == ["pods"] and "create" in rule["verbs"]:
            assert rule["verbs"] == ["create", "delete"]
    (own,) = by_kind(docs, "Role")
    assert own["metadata"]["namespace"] == "hyperpod-sdc"
    secret_rules = [r for r in own["rules"] if "secrets" in r["resources"]]
    assert {v for r in secret_rules for v in r["verbs"]} == {"create", "get"}
    assert all(
        r.get("resourceNames") == ["hyperpod-sdc-attestation"]
        for r in secret_rules
        if "get" in r["verbs"]
    )
    (secret,) = by_kind(docs, "Secret")
    assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}


def test_the_generated_certificate_and_ca_are_ecdsa_p256() -> None:
    """Before: genCA's RSA-2048, whose handshakes cost the operator more CPU under a
    storm (docs/operator.md, "Memory and connections"); cert-manager's was ECDSA already."""
    import base64

    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    (secret,) = by_kind(render(), "Secret")
    pem = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    key = load_pem_private_key(pem["tls.key"], None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    cert, ca = (
        x509.load_pem_x509_certificate(pem["tls.crt"]),
        x509.load_pem_x509_certificate(pem["ca.crt"]),
    )
    for public in (cert.public_key(), ca.public_key()):
        assert isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp256r1"
    cert.verify_directly_issued_by(ca)
    assert "hyperpod-sdc.hyperpod-sdc.svc" in cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName)


def test_confirmation_off_grants_no_pod_writes() -> None:
    (role,) = by_kind(render({"confirmation": {"enabled": False}}), "ClusterRole")
    pod_verbs = {v for r in role["rules"] if "pods" in r["resources"] for v in r["verbs"]}
    assert pod_verbs == {"get", "list", "watch"}
    (deploy,) = by_kind(render({"confirmation": {"enabled": False}}), "Deployment")
    env = {
        e["name"]: e.get("value")
        for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["HYPERPOD_SDC_CONFIRMATION"] == "false"


def test_every_env_setting_the_operator_reads_is_set_from_values() -> None:
    from sdc_operator.settings import ENV_OF_FIELD

    (deploy,) = by_kind(render(), "Deployment")
    env = {e["name"] for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    # the listen address keeps its default (all interfaces); auth mode and static tokens
    # are for development only, and body size stays at the protocol's limit
    not_in_chart = {
        "HYPERPOD_SDC_LISTEN_ADDRESS",
        "HYPERPOD_SDC_AUTH_MODE",
        "HYPERPOD_SDC_STATIC_TOKENS_FILE",
        "HYPERPOD_SDC_MAX_BODY_BYTES",
    }
    assert set(ENV_OF_FIELD.values()) - not_in_chart <= env


def test_optional_parts() -> None:
    docs = render(ALL_ON)
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"][0]["tlsConfig"]["ca"]["secret"]["key"] == "ca.crt"
    policies = {p["metadata"]["name"]: p for p in by_kind(docs, "NetworkPolicy")}
    assert policies["hyperpod-sdc-intake"]["spec"]["ingress"][0]["from"][0][
        "namespaceSelector"
    ] == {"matchLabels": {"team": "ml"}}
    assert policies["hyperpod-sdc-admission"]["spec"]["ingress"][0]["from"] == [
        {"ipBlock": {"cidr": "10.0.0.0/16"}}
    ]
    assert not by_kind(docs, "ConfigMap")  # the operator publishes the CA itself
    (hook,) = by_kind(docs, "MutatingWebhookConfiguration")
    assert {w["failurePolicy"] for w in hook["webhooks"]} == {"Fail"}
    (deploy,) = by_kind(docs, "Deployment")
    env = {
        e["name"]: e.get("value")
        for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert (env["HYPERPOD_SDC_NAMESPACES"], env["HYPERPOD_SDC_DRY_RUN"]) == ("ml", "true")


MONITORING = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def ingress_pairs(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """What the rendered NetworkPolicies allow, added up as the CNI adds them: a set of
    (peer as JSON, port name)."""
    import json

    allowed = set()
    for policy in by_kind(docs, "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress") or []:
            assert rule.get("from"), f"{policy['metadata']['name']}: a rule open to everyone"
            assert rule.get("ports"), f"{policy['metadata']['name']}: a rule open on every port"
            for peer in rule["from"]:
                for port in rule["ports"]:
                    allowed.add((json.dumps(peer, sort_keys=True), port["port"]))
    return allowed


def test_each_listener_has_its_own_port_service_and_network_policy() -> None:
    """The tenants' namespaces reach only the intake's two ports (its own and the verdict
    port), the API server only the admission port, monitoring only the metrics port; the
    webhook configuration, the probes and the ServiceMonitor name their own listener, and
    the pods are told the verdict port's URL."""
    import json

    values = {
        **ALL_ON,
        "networkPolicy": {**ALL_ON["networkPolicy"], "metricsFrom": MONITORING},
    }
    docs = render(values)
    (deploy,) = by_kind(docs, "Deployment")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"intake": 8443, "verdicts": 8444, "admission": 9443, "metrics": 9090}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (
        env["HYPERPOD_SDC_LISTEN_PORT"],
        env["HYPERPOD_SDC_VERDICT_PORT"],
        env["HYPERPOD_SDC_ADMISSION_PORT"],
        env["HYPERPOD_SDC_METRICS_PORT"],
    ) == ("8443", "8444", "9443", "9090")
    assert env["HYPERPOD_SDC_INJECT_VERDICT_URL"] == ("https://hyperpod-sdc.hyperpod-sdc.svc:8444")
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics"
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    assert {
        name: [p["targetPort"] for p in s["spec"]["ports"]] for name, s in services.items()
    } == {
        "hyperpod-sdc": ["intake", "verdicts"],
        "hyperpod-sdc-webhook": ["admission"],
        "hyperpod-sdc-metrics": ["metrics"],
    }
    (hook,) = by_kind(docs, "MutatingWebhookConfiguration")
    assert {w["clientConfig"]["service"]["name"] for w in hook["webhooks"]} == {
        "hyperpod-sdc-webhook"
    }
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    selected = [
        name
        for name, s in services.items()
        if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert selected == ["hyperpod-sdc-metrics"]
    tenants = json.dumps({"namespaceSelector": {"matchLabels": {"team": "ml"}}}, sort_keys=True)
    api_server = json.dumps({"ipBlock": {"cidr": "10.0.0.0/16"}}, sort_keys=True)
    monitoring = json.dumps(MONITORING[0], sort_keys=True)
    assert ingress_pairs(docs) == {
        (tenants, "intake"),
        (tenants, "verdicts"),
        (api_server, "admission"),
        (monitoring, "metrics"),
    }
    # the defaults: every namespace may report, nobody but the node scrapes
    docs = render(
        {"networkPolicy": {"enabled": True, "webhookFrom": ALL_ON["networkPolicy"]["webhookFrom"]}}
    )
    assert ingress_pairs(docs) == {
        (json.dumps({"namespaceSelector": {}}), "intake"),
        (json.dumps({"namespaceSelector": {}}), "verdicts"),
        (api_server, "admission"),
    }
    # without the webhook no one is let in on the admission port
    docs = render({"networkPolicy": {"enabled": True}, "webhook": {"enabled": False}})
    assert {port for _, port in ingress_pairs(docs)} == {"intake", "verdicts"}
    # the operator's certificate names each Service
    (cert,) = [
        d for d in render(CERT_MANAGER) if d["kind"] == "Certificate" and "dnsNames" in d["spec"]
    ]
    for name in services:
        assert f"{name}.hyperpod-sdc.svc" in cert["spec"]["dnsNames"]


def test_verdict_port_zero_leaves_no_verdict_listener_anywhere() -> None:
    """``service.verdictPort: 0`` turns the verdict port off: the operator listens on none
    (HYPERPOD_SDC_VERDICT_PORT=0), no Service or NetworkPolicy names it, and the webhook
    tells the agents of none, so every report goes to the intake's port."""
    values = {**ALL_ON, "service": {"verdictPort": 0}}
    docs = render(values)
    (deploy,) = by_kind(docs, "Deployment")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in container["ports"]] == ["intake", "admission", "metrics"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HYPERPOD_SDC_VERDICT_PORT"] == "0"
    assert "HYPERPOD_SDC_INJECT_VERDICT_URL" not in env
    assert "HYPERPOD_SDC_INJECT_OPERATOR_URL" in env
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    assert [p["name"] for p in services["hyperpod-sdc"]["spec"]["ports"]] == ["intake"]
    assert {port for _, port in ingress_pairs(docs)} == {"intake", "admission"}
    with pytest.raises(Exception, match="verdictPort"):
        render({"service": {"verdictPort": -1}})


def test_the_creator_check_refuses_the_marker_from_anyone_but_a_trusted_creator() -> None:
    """The chart's ValidatingAdmissionPolicy (1.30+) and validating webhook (older API
    servers) state one rule: the policy's CEL, evaluated offline as the API server would,
    decides every case as sdc_operator.attestation.creator_refusal does."""
    celpy = pytest.importorskip("celpy")
    from tests.operator.test_policy_attestation import CREATOR_CASES, OPERATOR

    values = {"webhook": {"creatorCheck": "policy"}, "operator": {"trustedPodCreators": [OPERATOR]}}
    docs = render(values)
    (policy,) = by_kind(docs, "ValidatingAdmissionPolicy")
    (binding,) = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert not by_kind(docs, "ValidatingWebhookConfiguration")
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    marker = {"key": "hyperpod-sdc.dev/attested", "operator": "Exists"}
    assert spec["matchConstraints"]["objectSelector"] == {"matchExpressions": [marker]}
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["operations"] == ["CREATE", "UPDATE"] and "pods" in rule["resources"]
    env = celpy.Environment()

    def allowed(operation: str, pod: Any, old: Any, user: str) -> bool:
        activation = {
            "object": celpy.json_to_cel(pod),
            "oldObject": celpy.json_to_cel(old),
            "request": celpy.json_to_cel({"operation": operation, "userInfo": {"username": user}}),
        }
        variables: dict[Any, Any] = {}
        for variable in spec["variables"]:
            program = env.program(env.compile(variable["expression"]))
            variables[celpy.celtypes.StringType(variable["name"])] = program.evaluate(activation)
        activation["variables"] = celpy.celtypes.MapType(variables)
        return all(
            bool(env.program(env.compile(v["expression"])).evaluate(activation))
            for v in spec["validations"]
        )

    for operation, pod, old, user, refused in CREATOR_CASES:
        assert allowed(operation, pod, old, user) is (refused is None), (operation, user, refused)
    # the webhook variant: every marked pod is sent, and a failure refuses it
    (hook,) = by_kind(
        render({"webhook": {"creatorCheck": "webhook"}}), "ValidatingWebhookConfiguration"
    )
    (entry,) = hook["webhooks"]
    assert entry["failurePolicy"] == "Fail"
    assert entry["objectSelector"] == {"matchExpressions": [marker]}
    assert entry["clientConfig"]["service"]["name"] == "hyperpod-sdc-webhook"
    assert entry["clientConfig"]["service"]["path"] == "/v1/admission/pods/creator"
    assert entry["namespaceSelector"]["matchExpressions"][0]["values"] == [
        "kube-system",
        "hyperpod-sdc",
    ]
    # auto: the webhook where the cluster (here: Helm's offline default) has no policy API
    assert by_kind(render(), "ValidatingWebhookConfiguration")
    assert not by_kind(
        render({"webhook": {"enabled": False}, "networkPolicy": {"enabled": False}}),
        "ValidatingAdmissionPolicy",
    )


def test_the_operator_finds_the_creator_check_the_chart_installs() -> None:
    """What the operator looks for at start-up (sdc_operator.creator_check) is what the
    chart renders, in both variants, and the deployment tells it which; a check that
    misses pods/status, fails open or has no Deny binding is not one."""
    import copy

    from sdc_operator.creator_check import policy_problem, webhook_problem

    def env_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
        (deployment,) = by_kind(docs, "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for e in container["env"]}

    docs = render({"webhook": {"creatorCheck": "policy"}})
    (policy,) = by_kind(docs, "ValidatingAdmissionPolicy")
    (binding,) = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert policy_problem([policy], [binding]) is None
    assert env_of(docs)["HYPERPOD_SDC_CREATOR_CHECK"] == "policy"
    assert "no binding" in str(policy_problem([policy], []))
    audit = copy.deepcopy(binding)
    audit["spec"]["validationActions"] = ["Audit"]
    assert "no binding" in str(policy_problem([policy], [audit]))
    docs = render({"webhook": {"creatorCheck": "webhook"}})
    (hook,) = by_kind(docs, "ValidatingWebhookConfiguration")
    assert webhook_problem([hook]) is None
    assert env_of(docs)["HYPERPOD_SDC_CREATOR_CHECK"] == "webhook"
    (rule,) = hook["webhooks"][0]["rules"]
    assert rule["resources"] == ["pods", "pods/status"]
    for broken, said in (
        ({"rules": [{**rule, "resources": ["pods"]}]}, "does not send CREATE pods/status"),
        ({"failurePolicy": "Ignore"}, "failurePolicy Ignore"),
    ):
        bad = copy.deepcopy(hook)
        bad["webhooks"][0].update(broken)
        assert said in str(webhook_problem([bad]))
    (mutating,) = by_kind(docs, "MutatingWebhookConfiguration")
    assert "no ValidatingWebhookConfiguration" in str(webhook_problem([mutating]))
    # no webhook, no check: the operator looks for either, and does not start without
    off = render({"webhook": {"enabled": False}, "networkPolicy": {"enabled": False}})
    assert env_of(off)["HYPERPOD_SDC_CREATOR_CHECK"] == "any"
    (role,) = [d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"] == "hyperpod-sdc"]
    admission = [r for r in role["rules"] if r["apiGroups"] == ["admissionregistration.k8s.io"]]
    assert admission == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": [
                "validatingwebhookconfigurations",
                "validatingadmissionpolicies",
                "validatingadmissionpolicybindings",
            ],
            "verbs": ["list"],
        }
    ]


def test_the_optional_policy_is_valid_and_off_by_default() -> None:
    import jsonschema

    assert not by_kind(render(), "SDCPolicy")
    (policy,) = by_kind(render(ALL_ON), "SDCPolicy")
    assert policy["metadata"]["name"] == "ml-teams" and "namespace" not in policy["metadata"]
    assert policy["spec"] == {
        "namespaces": ["ml"],
        "namespaceSelector": {"matchLabels": {"team": "ml"}},
        "remediationPolicy": "manual",
        "dryRun": False,
        "approvals": "namespace",
    }
    crd = yaml.safe_load((CHART / "crds" / "hyperpod-sdc.dev_sdcpolicies.yaml").read_text())
    jsonschema.validate(policy, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def test_tls_off_and_existing_secret() -> None:
    with pytest.raises(helm.HelmError, match="webhook.enabled needs tls.enabled"):
        render({"tls": {"enabled": False}})
    docs = render({"tls": {"enabled": False}, "webhook": {"enabled": False}})
    assert not by_kind(docs, "Secret") and not by_kind(docs, "MutatingWebhookConfiguration")
    (deploy,) = by_kind(docs, "Deployment")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["scheme"] == "HTTP"
    assert "HYPERPOD_SDC_TLS_CERT_FILE" not in {e["name"] for e in container["env"]}
    with pytest.raises(helm.HelmError, match="tls.caBundle"):
        render({"tls": {"existingSecret": "my-cert"}})
    docs = render({"tls": {"existingSecret": "my-cert", "caBundle": TEST_CA}})
    assert not by_kind(docs, "Secret")
    (deploy,) = by_kind(docs, "Deployment")
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "my-cert"


def test_notes_tell_how_to_opt_in_and_where_to_look() -> None:
    chart = helm.Chart.load(str(CHART))
    notes = chart.render({}, name="hyperpod-sdc", namespace="hyperpod-sdc", is_install=True)[
        "hyperpod-sdc/templates/NOTES.txt"
    ]
    for text in (
        'hyperpod-sdc.dev/enabled: "true"',
        "https://hyperpod-sdc.hyperpod-sdc.svc:443",
        "kubectl get sdcincidents",
        'audience "hyperpod-sdc"',
    ):
        assert text in notes


def test_dockerfile_is_multi_stage_non_root_and_torch_free() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) == 2
    assert re.search(r"^USER 65532", text, re.M)
    assert (
        '"hyperpod-sdc[operator]"' in text
        and "[agent]" not in text.split("FROM")[-1].split("USER")[0]
    )
    assert 'ENTRYPOINT ["python", "-m", "sdc_operator"]' in text
    # the three source folders, the shared one included (the operator imports sdc_common)
    assert all(f"COPY {d} ./{d}" in text for d in ("sidecar", "operator", "common"))


@pytest.mark.slow  # an install into a fresh venv: 12 s to 35 s with pip on 2 cores, 5 s with uv
def test_the_images_install_recipe_gives_a_torch_free_operator(tmp_path: Path) -> None:
    """The Dockerfile's two RUN steps (no container runtime here): a wheel of the project,
    installed with the operator extra into a clean environment, runs without torch.

    Cheaper than the image's own steps where that changes nothing the test checks: the
    wheel is built with this environment's pinned setuptools (no isolated build
    environment to install first), and the clean environment has no pip of its own (uv,
    where scripts/bootstrap.sh put it beside this interpreter, or else this environment's
    pip installs into it, with pip's configuration either way), no bytecode compiled (the
    image sets PYTHONDONTWRITEBYTECODE); its packages are exactly the wheel and what its
    operator extra pulls in under constraints.txt."""
    import os
    import shutil
    import subprocess
    import sys
    import venv

    import uv_pip

    # Away from the source tree and its PYTHONPATH: only what the wheel installed (with
    # the tree on the path, pip would take the project's egg-info that building the wheel
    # leaves there for the installed project, and install nothing).
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("hyperpod_sdc-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    install = ["-c", str(ROOT / "constraints.txt"), f"{wheel}[operator]"]
    command: list[str] | None = None
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is not None:
        try:
            command, env = uv_pip.command(sys.executable, uv, str(python), ["-q", *install])
            env.pop("PYTHONPATH", None)
        except uv_pip.Untranslatable:
            pass
    if command is None:
        command = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
        command += ["--no-compile", *install]
        env = clean
    subprocess.run(command, check=True, capture_output=True, env=env)
    check = (
        "import importlib.util, sys, sdc_operator.handlers, sdc_operator.__main__\n"
        "assert importlib.util.find_spec('torch') is None, 'torch was installed'\n"
        "assert importlib.util.find_spec('pip') is None, 'not the clean environment'\n"
        "assert 'sdc_agent' not in sys.modules, 'the operator imported the agent'\n"
        f"assert sdc_operator.handlers.__file__.startswith({str(env_dir)!r}), 'not the wheel'\n"
    )
    subprocess.run(
        [str(python), "-c", check], check=True, capture_output=True, cwd=tmp_path, env=clean
    )


def test_webhook_registration_never_makes_other_pods_wait() -> None:
    import base64

    docs = render()
    (hook,) = by_kind(docs, "MutatingWebhookConfiguration")
    (secret,) = by_kind(docs, "Secret")
    assert [w["name"] for w in hook["webhooks"]] == [
        "kubeflow.pods.hyperpod-sdc.dev",
        "labelled.pods.hyperpod-sdc.dev",
    ]
    selectors = []
    for webhook in hook["webhooks"]:
        assert webhook["failurePolicy"] == "Ignore" and webhook["timeoutSeconds"] == 5
        assert webhook["sideEffects"] == "None" and webhook["admissionReviewVersions"] == ["v1"]
        assert webhook["rules"] == [
            {
                "operations": ["CREATE", "UPDATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ]
        assert webhook["namespaceSelector"] == {
            "matchExpressions": [
                {
                    "key": "kubernetes.io/metadata.name",
                    "operator": "NotIn",
                    "values": ["kube-system", "hyperpod-sdc"],
                }
            ]
        }
        assert webhook["clientConfig"]["service"] == {
            "name": "hyperpod-sdc-webhook",
            "namespace": "hyperpod-sdc",
            "path": "/v1/admission/pods",
            "port": 443,
        }
        # the API server trusts exactly the CA that signed the operator's certificate
        assert webhook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
        assert base64.b64decode(webhook["clientConfig"]["caBundle"]).startswith(b"-----BEGIN")
        selectors.append(webhook["objectSelector"])
    assert selectors == [
        {"matchLabels": {"training.kubeflow.org/operator-name": "pytorchjob-controller"}},
        {"matchLabels": {"hyperpod-sdc.dev/inject": "true"}},
    ]
    (deploy,) = by_kind(docs, "Deployment")
    env = {
        e["name"]: e.get("value")
        for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    # the operator knows which pods the webhook is sent, and the pods' URL
    import json

    from sdc_operator.injection import DEFAULT_POD_SELECTORS

    assert json.loads(env["HYPERPOD_SDC_WEBHOOK_POD_SELECTORS"]) == selectors
    assert tuple(selectors) == DEFAULT_POD_SELECTORS
    assert env["HYPERPOD_SDC_INJECT_OPERATOR_URL"] == "https://hyperpod-sdc.hyperpod-sdc.svc:443"
    assert env["HYPERPOD_SDC_TLS_CA_FILE"] == "/etc/hyperpod-sdc/tls/ca.crt"
    assert env["HYPERPOD_SDC_TRUSTED_POD_CREATORS"].split(",")[0] == (
        "system:serviceaccount:kubeflow:training-operator"
    )
    extra = render({"webhook": {"namespaceSelector": {"matchLabels": {"team": "ml"}}}})
    (hook,) = by_kind(extra, "MutatingWebhookConfiguration")
    assert hook["webhooks"][0]["namespaceSelector"]["matchLabels"] == {"team": "ml"}
    assert len(hook["webhooks"][0]["namespaceSelector"]["matchExpressions"]) == 1


def test_every_webhook_setting_the_operator_reads_is_set_from_values() -> None:
    from sdc_operator.webhook import WEBHOOK_ENV

    (deploy,) = by_kind(render(), "Deployment")
    env = {e["name"] for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert set(WEBHOOK_ENV.values()) <= env


def test_bad_webhook_values_are_refused() -> None:
    chart = helm.Chart.load(str(CHART))
    for values, where in (
        ({"webhook": {"failurePolicy": "ignore"}}, "failurePolicy"),
        ({"webhook": {"timeoutSeconds": 31}}, "timeoutSeconds"),
        ({"webhook": {"podSelectors": [{"name": "all", "objectSelector": {}}]}}, "objectSelector"),
        ({"webhook": {"podSelectors": []}}, "podSelectors"),
        ({"certManager": {"issuerRef": {"name": "x", "kind": "Secret"}}}, "kind"),
    ):
        with pytest.raises(helm.HelmValuesError, match=where):
            chart.render(values, name="x", namespace="x")
    with pytest.raises(helm.HelmError, match="networkPolicy.webhookFrom"):
        render({"networkPolicy": {"enabled": True}})


def test_cert_manager_gives_a_stable_ca_and_injects_the_bundle() -> None:
    docs = render(CERT_MANAGER)
    assert not by_kind(docs, "Secret")  # cert-manager writes it
    (hook,) = by_kind(docs, "MutatingWebhookConfiguration")
    assert hook["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "hyperpod-sdc/hyperpod-sdc-tls"
    }
    assert all("caBundle" not in w["clientConfig"] for w in hook["webhooks"])
    certificates = {c["metadata"]["name"]: c for c in by_kind(docs, "Certificate")}
    serving, ca = certificates["hyperpod-sdc-tls"], certificates["hyperpod-sdc-ca"]
    assert ca["spec"]["isCA"] is True and ca["spec"]["privateKey"]["rotationPolicy"] == "Never"
    assert "hyperpod-sdc.hyperpod-sdc.svc" in serving["spec"]["dnsNames"]
    assert serving["spec"]["issuerRef"] == {
        "name": "hyperpod-sdc-ca",
        "kind": "Issuer",
        "group": "cert-manager.io",
    }
    (deploy,) = by_kind(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == serving["spec"]["secretName"]
    # renewed in place and reloaded by the operator: no restart on a new certificate
    assert "checksum/tls" not in (deploy["spec"]["template"]["metadata"].get("annotations") or {})
    own = render(
        {"certManager": {"enabled": True, "issuerRef": {"name": "corp", "kind": "ClusterIssuer"}}}
    )
    (serving,) = by_kind(own, "Certificate")
    assert serving["spec"]["issuerRef"] == {
        "name": "corp",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    assert not by_kind(own, "Issuer")


def test_offline_renders_keep_the_ca_only_with_cert_manager_or_an_existing_secret() -> None:
    """What Argo CD does on every sync: render without the cluster. The chart's generated
    CA changes every time (documented); cert-manager's and an existing Secret's do not."""
    import yaml as yaml_

    for values in (CERT_MANAGER, {"tls": {"existingSecret": "corp-tls", "caBundle": TEST_CA}}):
        assert yaml_.safe_dump_all(render(values)) == yaml_.safe_dump_all(render(values))
    first, second = by_kind(render(), "Secret"), by_kind(render(), "Secret")
    assert first[0]["data"]["ca.crt"] != second[0]["data"]["ca.crt"]
    docs = render({"tls": {"existingSecret": "corp-tls", "caBundle": TEST_CA}})
    (hook,) = by_kind(docs, "MutatingWebhookConfiguration")
    import base64

    assert base64.b64decode(hook["webhooks"][0]["clientConfig"]["caBundle"]).decode() == TEST_CA


def test_the_uninstall_hook() -> None:
    """A pre-delete Job with its own narrow roles (docs/operator.md, "Uninstall"): it stops
    the operator, releases nodes only when asked, and can delete nothing but ConfigMaps and
    pods; with uninstall.cleanup off there is no hook at all."""
    docs = [d for d in render(hooks=True) if hook(d) is not None]
    assert {hook(d) for d in docs} == {"pre-delete"}
    assert sorted(d["kind"] for d in docs) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Job",
        "Role",
        "RoleBinding",
        "ServiceAccount",
    ]
    for doc in docs:
        policy = doc["metadata"]["annotations"]["helm.sh/hook-delete-policy"]
        assert policy == "before-hook-creation,hook-succeeded"
        weight = int(doc["metadata"]["annotations"]["helm.sh/hook-weight"])
        assert weight == (0 if doc["kind"] == "Job" else -10)  # its roles exist before it runs
    (job,) = by_kind(docs, "Job")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == [
        "kubectl-sdc",
        "uninstall",
        "--stop",
        "hyperpod-sdc/hyperpod-sdc",
    ]
    assert pod["serviceAccountName"] == "hyperpod-sdc-uninstall" and pod["restartPolicy"] == "Never"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    (role,) = by_kind(docs, "ClusterRole")
    verbs = {r["resources"][0]: r["verbs"] for r in role["rules"]}
    assert verbs["nodes"] == ["get", "list"]  # no patch: nodes stay quarantined by default
    for rule in role["rules"]:
        assert "secrets" not in rule["resources"] and "*" not in rule["verbs"]
        if "delete" in rule["verbs"]:
            assert rule["resources"] == ["configmaps", "pods"]
    (own,) = by_kind(docs, "Role")
    assert {r["resources"][0]: r["resourceNames"] for r in own["rules"]} == {
        "deployments": ["hyperpod-sdc"],
        "deployments/scale": ["hyperpod-sdc"],
    }
    released = [d for d in render({"uninstall": {"releaseNodes": True}}, hooks=True) if hook(d)]
    (job,) = by_kind(released, "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] == "--release-nodes"
    (role,) = by_kind(released, "ClusterRole")
    assert role["rules"][0] == {
        "apiGroups": [""],
        "resources": ["nodes"],
        "verbs": ["get", "list", "patch"],
    }
    assert not [d for d in render({"uninstall": {"cleanup": False}}, hooks=True) if hook(d)]
