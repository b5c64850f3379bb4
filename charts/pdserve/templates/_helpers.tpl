{{/* Names are the release name plus a suffix, capped at the 63 characters a label value allows. */}}
{{- define "pdserve.operatorName" -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: pdserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Relabelings shared by the PodMonitor and ServiceMonitor: the dashboards group by role and modelserving. */}}
{{- define "pdserve.relabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_pdserve_io_role]
  targetLabel: role
- sourceLabels: [__meta_kubernetes_pod_label_pdserve_io_modelserving]
  targetLabel: modelserving
- sourceLabels: [__meta_kubernetes_pod_label_pdserve_io_revision]
  targetLabel: revision
- sourceLabels: [__meta_kubernetes_namespace]
  targetLabel: namespace
- sourceLabels: [__meta_kubernetes_pod_name]
  targetLabel: pod
{{- end -}}

{{/* The worker API key every scrape presents: workers answer /metrics 401 without it. The
Prometheus Operator reads the Secret from the monitor's namespace (the release's). */}}
{{- define "pdserve.bearerTokenSecret" -}}
{{- with .Values.monitoring.workerApiKeySecret.name }}
bearerTokenSecret:
  name: {{ . }}
  key: {{ $.Values.monitoring.workerApiKeySecret.key }}
{{- end }}
{{- end -}}
