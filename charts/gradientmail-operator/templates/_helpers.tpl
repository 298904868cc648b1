{{/* Names, labels, images and the operator's command line. */}}

{{- define "gradientmail-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gradientmail-operator.fullname" -}}
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

{{- define "gradientmail-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gradientmail-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gradientmail-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gradientmail-operator.labels" -}}
helm.sh/chart: {{ include "gradientmail-operator.chart" . }}
{{ include "gradientmail-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gradientmail
{{- end }}

{{- define "gradientmail-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gradientmail-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gradientmail-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "gradientmail-operator.nodeImage" -}}
{{- printf "%s:%s" .Values.nodePods.image.repository (default .Chart.AppVersion .Values.nodePods.image.tag) }}
{{- end }}

{{/* `regcred,other`: GRADIENTMAIL_OPERATOR_NODE_IMAGE_PULL_SECRETS. */}}
{{- define "gradientmail-operator.nodePullSecrets" -}}
{{- $names := list }}
{{- range .Values.nodePods.imagePullSecrets }}
{{- $names = append $names .name }}
{{- end }}
{{- $names | uniq | join "," }}
{{- end }}

{{/* The metrics port, checked against the health port (both are the operator's). */}}
{{- define "gradientmail-operator.metricsPort" -}}
{{- if eq (int .Values.metrics.port) (int .Values.operator.healthPort) }}
{{- fail (printf "metrics.port and operator.healthPort are both %v: give them different ports" .Values.metrics.port) }}
{{- end }}
{{- .Values.metrics.port }}
{{- end }}

{{- define "gradientmail-operator.metricsLabels" -}}
{{ include "gradientmail-operator.labels" . }}
app.kubernetes.io/component: metrics
{{- end }}

{{/* A namespace where runs are served: the first watched one, or "" (any: no -n flag). */}}
{{- define "gradientmail-operator.runNamespace" -}}
{{- if .Values.watchNamespaces }}
{{- first (.Values.watchNamespaces | uniq) }}
{{- end }}
{{- end }}

{{/* The watched namespaces, deduplicated, in the given order. */}}
{{- define "gradientmail-operator.watchNamespaces" -}}
{{- .Values.watchNamespaces | uniq | toJson }}
{{- end }}

{{/* `k=v,k2=v2`, sorted by key: GRADIENTMAIL_OPERATOR_POD_LABELS. */}}
{{- define "gradientmail-operator.nodePodLabels" -}}
{{- $pairs := list }}
{{- range $key := keys .Values.nodePods.labels | sortAlpha }}
{{- $pairs = append $pairs (printf "%s=%s" $key (get $.Values.nodePods.labels $key)) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/* kopf run's arguments. --standalone: no kopf peering (see the chart README). */}}
{{- define "gradientmail-operator.args" -}}
- --module=gradientmail_operator.handlers
- --standalone
{{- if .Values.watchNamespaces }}
{{- range $ns := .Values.watchNamespaces | uniq }}
- --namespace={{ $ns }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
- --liveness=http://0.0.0.0:{{ .Values.operator.healthPort }}/healthz
- --log-format={{ .Values.operator.logFormat }}
{{- if eq .Values.operator.logLevel "debug" }}
- --debug
{{- else if eq .Values.operator.logLevel "warning" }}
- --quiet
{{- end }}
{{- end }}

{{/*
The rules the operator needs in each namespace it serves: its own calls
(gradientmail_operator.kube.CALLS) and kopf's (FRAMEWORK_CALLS). tests/charts checks them
against both lists and against every request the running operator makes.
*/}}
{{- define "gradientmail-operator.namespacedRules" -}}
- apiGroups: [gradientmail.dev]
  resources: [gradientmailruns]
  verbs: [list, watch, patch]
- apiGroups: [gradientmail.dev]
  resources: [gradientmailruns/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}

{{/* Cluster-wide mode only: kopf's observation of CRDs (CLUSTER_SCANNING_CALLS). */}}
{{- define "gradientmail-operator.clusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}
