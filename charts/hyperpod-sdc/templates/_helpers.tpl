{{/* The chart's name, truncated to a DNS label. */}}
{{- define "hyperpod-sdc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name of the release's objects. */}}
{{- define "hyperpod-sdc.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "hyperpod-sdc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hyperpod-sdc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "hyperpod-sdc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "hyperpod-sdc.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "hyperpod-sdc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hyperpod-sdc.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "hyperpod-sdc.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "hyperpod-sdc.fullname" .)) .Values.tls.existingSecret }}
{{- end }}

{{/* The operator's in-cluster URL, as the agents reach it. */}}
{{- define "hyperpod-sdc.operatorURL" -}}
{{- printf "%s://%s.%s.svc:%v" (ternary "https" "http" .Values.tls.enabled) (include "hyperpod-sdc.fullname" .) .Release.Namespace .Values.service.port }}
{{- end }}

{{/* The intake's verdict port as the agents reach it (HYPERPOD_SDC_VERDICT_URL). */}}
{{- define "hyperpod-sdc.verdictURL" -}}
{{- printf "%s://%s.%s.svc:%v" (ternary "https" "http" .Values.tls.enabled) (include "hyperpod-sdc.fullname" .) .Release.Namespace .Values.service.verdictPort }}
{{- end }}

{{/* Where the chart's TLS comes from: generated, existingSecret or certManager. */}}
{{- define "hyperpod-sdc.tlsSource" -}}
{{- if .Values.certManager.enabled }}certManager
{{- else if .Values.tls.existingSecret }}existingSecret
{{- else }}generated
{{- end }}
{{- end }}

{{/*
The MutatingWebhookConfiguration, with the CA that signed the operator's certificate as
its caBundle (PEM in .caBundle), or cert-manager's CA injection. Rendered by tls.yaml where
the chart generates the CA (the same render must see the same random CA) and by
webhook.yaml otherwise.
*/}}
{{- define "hyperpod-sdc.webhookConfiguration" -}}
{{- $root := .root }}
{{- $fullname := include "hyperpod-sdc.fullname" $root }}
{{- $excluded := list "kube-system" $root.Release.Namespace }}
{{- $nsSelector := $root.Values.webhook.namespaceSelector }}
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: {{ $fullname }}
  labels:
    {{- include "hyperpod-sdc.labels" $root | nindent 4 }}
  {{- if $root.Values.certManager.enabled }}
  annotations:
    # cert-manager's cainjector writes the Certificate's CA into every caBundle below
    cert-manager.io/inject-ca-from: {{ $root.Release.Namespace }}/{{ $fullname }}-tls
  {{- end }}
webhooks:
  {{- range $root.Values.webhook.podSelectors }}
  - name: {{ .name }}.pods.hyperpod-sdc.dev
    admissionReviewVersions: [v1]
    sideEffects: None
    failurePolicy: {{ $root.Values.webhook.failurePolicy }}
    timeoutSeconds: {{ $root.Values.webhook.timeoutSeconds }}
    matchPolicy: Equivalent
    reinvocationPolicy: Never
    clientConfig:
      service:
        name: {{ $fullname }}-webhook
        namespace: {{ $root.Release.Namespace }}
        path: /v1/admission/pods
        port: {{ $root.Values.service.port }}
      {{- if $.caBundle }}
      caBundle: {{ $.caBundle | b64enc }}
      {{- end }}
    rules:
      - operations: [CREATE, UPDATE]
        apiGroups: [""]
        apiVersions: [v1]
        resources: [pods]
        scope: Namespaced
    # Never the operator's own namespace or kube-system: nothing there waits for it.
    namespaceSelector:
      {{- with $nsSelector.matchLabels }}
      matchLabels:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      matchExpressions:
        - key: kubernetes.io/metadata.name
          operator: NotIn
          values:
            {{- toYaml $excluded | nindent 12 }}
        {{- with $nsSelector.matchExpressions }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    # Only the training operators' pods are sent: no other pod waits for the operator.
    objectSelector:
      {{- toYaml .objectSelector | nindent 6 }}
  {{- end }}
{{- if eq (include "hyperpod-sdc.creatorCheck" $root) "webhook" }}
---
# The creator check for clusters without ValidatingAdmissionPolicy (docs/operator.md,
# "Threat model"): every pod that carries the marker label is sent, and refused unless a
# trusted creator set it. Fail, always: a marked pod this check did not answer for is
# refused, never admitted.
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: {{ $fullname }}-creator
  labels:
    {{- include "hyperpod-sdc.labels" $root | nindent 4 }}
  {{- if $root.Values.certManager.enabled }}
  annotations:
    cert-manager.io/inject-ca-from: {{ $root.Release.Namespace }}/{{ $fullname }}-tls
  {{- end }}
webhooks:
  - name: creator.pods.hyperpod-sdc.dev
    admissionReviewVersions: [v1]
    sideEffects: None
    failurePolicy: Fail
    timeoutSeconds: {{ $root.Values.webhook.timeoutSeconds }}
    matchPolicy: Equivalent
    clientConfig:
      service:
        name: {{ $fullname }}-webhook
        namespace: {{ $root.Release.Namespace }}
        path: /v1/admission/pods/creator
        port: {{ $root.Values.service.port }}
      {{- if $.caBundle }}
      caBundle: {{ $.caBundle | b64enc }}
      {{- end }}
    # pods/status too: a status update can write a pod's labels (on this project's 1.20
    # test API server it does), so it could add the marker
    rules:
      - operations: [CREATE, UPDATE]
        apiGroups: [""]
        apiVersions: [v1]
        resources: [pods, pods/status]
        scope: Namespaced
    namespaceSelector:
      {{- include "hyperpod-sdc.creatorNamespaces" $root | nindent 6 }}
    objectSelector:
      matchExpressions:
        - {key: hyperpod-sdc.dev/attested, operator: Exists}
{{- end }}
{{- end }}

{{/* Which creator check the chart installs: policy or webhook (webhook.creatorCheck). */}}
{{- define "hyperpod-sdc.creatorCheck" -}}
{{- $mode := .Values.webhook.creatorCheck }}
{{- if eq $mode "auto" }}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" }}policy{{ else }}webhook{{ end }}
{{- else }}{{ $mode }}{{ end }}
{{- end }}

{{/* Where the creator check applies: every namespace but kube-system and the release's
(not narrowed by webhook.namespaceSelector: a marked pod anywhere must be checked). */}}
{{- define "hyperpod-sdc.creatorNamespaces" -}}
matchExpressions:
  - key: kubernetes.io/metadata.name
    operator: NotIn
    values: [kube-system, {{ .Release.Namespace }}]
{{- end }}

{{/* The webhook's pod selectors, as the operator reads them (HYPERPOD_SDC_WEBHOOK_POD_SELECTORS). */}}
{{- define "hyperpod-sdc.podSelectorsJSON" -}}
{{- $selectors := list }}
{{- range .Values.webhook.podSelectors }}{{ $selectors = append $selectors .objectSelector }}{{ end }}
{{- toJson $selectors }}
{{- end }}

{{/* The DNS names of the operator's certificate: each of its three Services. */}}
{{- define "hyperpod-sdc.dnsNames" -}}
{{- $fullname := include "hyperpod-sdc.fullname" . }}
{{- $ns := .Release.Namespace }}
{{- $names := list }}
{{- range $service := list $fullname (printf "%s-webhook" $fullname) (printf "%s-metrics" $fullname) }}
{{- $names = concat $names (list $service (printf "%s.%s" $service $ns) (printf "%s.%s.svc" $service $ns) (printf "%s.%s.svc.cluster.local" $service $ns)) }}
{{- end }}
{{- toJson $names }}
{{- end }}
