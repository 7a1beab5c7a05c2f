{{/*
Name of the DaemonSet, its ServiceAccount and the other objects: resourceName, else "ztunnel".
*/}}
{{- define "ztunnel.name" -}}
{{- .Values.resourceName | default "ztunnel" -}}
{{- end }}

{{/*
Labels on every object: Kubernetes' recommended labels plus Istio's (istio.io/rev, the component).
*/}}
{{- define "ztunnel.labels" -}}
app.kubernetes.io/name: {{ include "ztunnel.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/part-of: istio
app.kubernetes.io/version: {{ include "ztunnel.tag" . | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | quote }}
istio.io/rev: {{ .Values.revision | default "default" | quote }}
operator.istio.io/component: Ztunnel
{{- with .Values.labels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "ztunnel.tag" -}}
{{- if eq (toString .Values.tag) "" }}{{ .Chart.AppVersion }}{{ else }}{{ toString .Values.tag }}{{ end -}}
{{- end }}

{{/*
The image reference: `image` verbatim when it holds a registry path, else <hub>/<image>:<tag>[-<variant>].
*/}}
{{- define "ztunnel.image" -}}
{{- if contains "/" .Values.image -}}
{{ .Values.image }}
{{- else -}}
{{ .Values.hub }}/{{ .Values.image }}:{{ include "ztunnel.tag" . }}{{ with .Values.variant }}-{{ . }}{{ end }}
{{- end -}}
{{- end }}

{{/*
istiod's gRPC address (xDS and CA share it): istiod[-<revision>].<istioNamespace>.svc:15012.
*/}}
{{- define "ztunnel.istiod" -}}
istiod{{ with .Values.revision }}-{{ . }}{{ end }}.{{ .Values.istioNamespace }}.svc:15012
{{- end }}

{{/*
Whether namespaced / cluster-scoped objects are rendered (resourceScope all | namespace | cluster).
*/}}
{{- define "ztunnel.namespaced" -}}
{{- if has .Values.resourceScope (list "all" "namespace") }}true{{ end -}}
{{- end }}
{{- define "ztunnel.clusterScoped" -}}
{{- if has .Values.resourceScope (list "all" "cluster") }}true{{ end -}}
{{- end }}
