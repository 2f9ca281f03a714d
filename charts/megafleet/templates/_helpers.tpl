{{/* The chart name (nameOverride wins). */}}
{{- define "megafleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The full name of every object: release name, plus the chart name unless the release holds it. */}}
{{- define "megafleet.fullname" -}}
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

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "megafleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "megafleet.labels" -}}
helm.sh/chart: {{ include "megafleet.chart" . }}
{{ include "megafleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: megafleet
{{- end }}

{{/* Stable labels selecting the operator pods (Deployment, metrics Service, NetworkPolicy). */}}
{{- define "megafleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "megafleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "megafleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "megafleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The ClusterKopfPeering object: named after the release. */}}
{{- define "megafleet.peeringName" -}}
{{- .Release.Name }}
{{- end }}

{{/* The image reference. */}}
{{- define "megafleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Namespaces the NetworkPolicy is created in. */}}
{{- define "megafleet.networkPolicyNamespaces" -}}
{{- if .Values.networkPolicy.namespaces }}
{{- toJson .Values.networkPolicy.namespaces }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{/* Fails the render with a clear message on inconsistent values. */}}
{{- define "megafleet.validateValues" -}}
{{- if lt (int .Values.replicaCount) 1 }}
{{- fail "replicaCount must be at least 1" }}
{{- end }}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.peering.enabled) }}
{{- fail "replicaCount > 1 needs peering.enabled=true: without peering every replica would act on every fleet" }}
{{- end }}
{{- if or (lt (int .Values.peering.priority) 0) (gt (int64 .Values.peering.priority) 2147483647) }}
{{- fail "peering.priority must be between 0 (random) and 2147483647" }}
{{- end }}
{{- if and (ne (int .Values.peering.priority) 0) (gt (int .Values.replicaCount) 1) }}
{{- fail "peering.priority set with replicaCount > 1 gives every replica the same priority, and a tie pauses all: leave it 0" }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.enabled) }}
{{- fail "metrics.serviceMonitor.enabled needs metrics.enabled=true" }}
{{- end }}
{{- if or (lt (int .Values.metrics.port) 1024) (gt (int .Values.metrics.port) 65535) }}
{{- fail "metrics.port must be between 1024 and 65535 (the operator runs as non-root)" }}
{{- end }}
{{- if eq (int .Values.metrics.port) (int .Values.networkPolicy.agentPort) }}
{{- fail "metrics.port must differ from the agents' port" }}
{{- end }}
{{- if ne (int .Values.networkPolicy.agentPort) 8471 }}
{{- fail "networkPolicy.agentPort is fixed by the API at 8471" }}
{{- end }}
{{- if and (not .Values.serviceAccount.create) (not .Values.serviceAccount.name) .Values.rbac.create }}
{{- fail "serviceAccount.create=false needs serviceAccount.name: the RBAC binding would otherwise grant the namespace's default ServiceAccount" }}
{{- end }}
{{- range .Values.operator.watchNamespaces }}
{{- if not (regexMatch "^[a-z0-9*?\\[\\]!-]+$" .) }}
{{- fail (printf "operator.watchNamespaces: %q is not a namespace name or glob" .) }}
{{- end }}
{{- end }}
{{- range .Values.autoscaling.fleets }}
{{- if not .name }}
{{- fail "autoscaling.fleets: every entry needs the fleet's name" }}
{{- end }}
{{- $min := ternary .minReplicas $.Values.autoscaling.minReplicas (hasKey . "minReplicas") }}
{{- $max := ternary .maxReplicas $.Values.autoscaling.maxReplicas (hasKey . "maxReplicas") }}
{{- if lt (int $max) (int $min) }}
{{- fail (printf "autoscaling.fleets %s: maxReplicas is below minReplicas" .name) }}
{{- end }}
{{- end }}
{{- if and .Values.autoscaling.fleets (not .Values.autoscaling.prometheusAddress) }}
{{- fail "autoscaling.fleets needs autoscaling.prometheusAddress (the Prometheus that scrapes the engines)" }}
{{- end }}
{{- end }}
