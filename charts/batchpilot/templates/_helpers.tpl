{{/* The release's full name, shared by the operator's objects. */}}
{{- define "batchpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "batchpilot.selectorLabels" -}}
app.kubernetes.io/name: batchpilot-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "batchpilot.labels" -}}
{{ include "batchpilot.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: batchpilot
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "batchpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "batchpilot.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the operator's admin key: the user's, or the chart's own. */}}
{{- define "batchpilot.adminKeySecret" -}}
{{- .Values.operator.adminKey.existingSecret | default (printf "%s-admin-key" (include "batchpilot.fullname" .)) -}}
{{- end -}}

{{- define "batchpilot.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* operator/rbac.py's rules (files/rbac-rules.yaml), plus the enabled optional sets.
     Argument: a dict with "root" (the chart context) and "scope" (cluster or namespaced). */}}
{{- define "batchpilot.rules" -}}
{{- $root := .root -}}
{{- $doc := $root.Files.Get "files/rbac-rules.yaml" | fromYaml -}}
{{- $rules := get $doc.rules .scope | default list -}}
{{- $optional := $doc.optional | default dict -}}
{{- range $name, $sets := $optional -}}
{{- $feature := get $root.Values.autoscaling $name | default dict -}}
{{- if $feature.enabled -}}
{{- $rules = concat $rules (get $sets $.scope | default list) -}}
{{- end -}}
{{- end -}}
{{- toYaml $rules -}}
{{- end -}}

{{/* The KopfPeering the operator's replicas share; empty: standalone. */}}
{{- define "batchpilot.peering" -}}
{{- if .Values.operator.peering -}}
{{- .Values.operator.peering -}}
{{- else if gt (int .Values.operator.replicas) 1 -}}
{{- include "batchpilot.fullname" . -}}
{{- end -}}
{{- end -}}
