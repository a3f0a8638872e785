{{/*
Names, labels and small builders shared by every template.
*/}}

{{- define "strata.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "strata.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Component names: kept to 52 characters so StatefulSet pod names and controller-revision labels fit in 63. */}}
{{- define "strata.coordinator.fullname" -}}
{{- printf "%s-coordinator" (include "strata.fullname" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- define "strata.stageWorker.fullname" -}}
{{- printf "%s-stage-worker" (include "strata.fullname" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- define "strata.stageWorker.headless" -}}
{{- printf "%s-headless" (include "strata.stageWorker.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "strata.etcd.fullname" -}}
{{- printf "%s-etcd" (include "strata.fullname" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- define "strata.etcd.headless" -}}
{{- printf "%s-headless" (include "strata.etcd.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "strata.tls.secretName" -}}
{{- default (printf "%s-tls" (include "strata.fullname" .)) .Values.tls.existingSecret -}}
{{- end -}}
{{- define "strata.auth.secretName" -}}
{{- default (printf "%s-api-keys" (include "strata.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}
{{- define "strata.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "strata.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "strata.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "strata.labels" -}}
helm.sh/chart: {{ include "strata.chart" . }}
{{ include "strata.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: strata
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "strata.selectorLabels" -}}
app.kubernetes.io/name: {{ include "strata.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Usage: include "strata.componentLabels" (dict "ctx" $ "component" "coordinator") */}}
{{- define "strata.componentLabels" -}}
{{ include "strata.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}
{{- define "strata.componentSelectorLabels" -}}
{{ include "strata.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Emits "\n  annotations: ..." (metadata level) or nothing. Call as {{- include "strata.commonAnnotations" . }} */}}
{{- define "strata.commonAnnotations" -}}
{{- with .Values.commonAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
{{- end }}
{{- end -}}

{{/*
Image reference. Usage: include "strata.image" (dict "image" .Values.coordinator.image "ctx" $)
An empty tag falls back to the chart's appVersion; a digest, when set, is appended and wins at pull time.
*/}}
{{- define "strata.image" -}}
{{- $registry := .image.registry -}}
{{- if .ctx.Values.global.imageRegistry -}}{{- $registry = .ctx.Values.global.imageRegistry -}}{{- end -}}
{{- $tag := default .ctx.Chart.AppVersion .image.tag | toString -}}
{{- $ref := .image.repository -}}
{{- if $registry -}}{{- $ref = printf "%s/%s" $registry $ref -}}{{- end -}}
{{- $ref = printf "%s:%s" $ref $tag -}}
{{- if .image.digest -}}{{- $ref = printf "%s@%s" $ref .image.digest -}}{{- end -}}
{{- $ref -}}
{{- end -}}

{{- define "strata.imagePullSecrets" -}}
{{- $secrets := concat (.Values.global.imagePullSecrets | default list) (.Values.imagePullSecrets | default list) | uniq -}}
{{- if $secrets }}
imagePullSecrets:
{{- range $secrets }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* etcd endpoints handed to coordinator and workers (comma separated when external). */}}
{{- define "strata.etcd.endpoints" -}}
{{- if .Values.etcd.external.endpoints -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else -}}
{{- printf "%s://%s.%s.svc.%s:%d" (ternary "https" "http" .Values.etcd.tls.enabled) (include "strata.etcd.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.etcd.service.clientPort) -}}
{{- end -}}
{{- end -}}

{{- define "strata.scheme" -}}
{{- if .Values.tls.enabled -}}https{{- else -}}http{{- end -}}
{{- end -}}

{{/* The coordinator's in-cluster addresses (used by the stage workers' preStop drain and by the helm test). */}}
{{- define "strata.coordinator.host" -}}
{{- printf "%s.%s.svc.%s" (include "strata.coordinator.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}
{{- define "strata.coordinator.grpcUrl" -}}
{{- printf "%s://%s:%d" (include "strata.scheme" .) (include "strata.coordinator.host" .) (int .Values.coordinator.service.ports.grpc) -}}
{{- end -}}
{{- define "strata.coordinator.httpUrl" -}}
{{- printf "%s://%s:%d" (include "strata.scheme" .) (include "strata.coordinator.host" .) (int .Values.coordinator.service.ports.http) -}}
{{- end -}}

{{/* Name the API reports the model under; defaults to the last element of model.path. */}}
{{- define "strata.model.name" -}}
{{- default (trimSuffix ".gguf" (base .Values.model.path)) .Values.model.name -}}
{{- end -}}

{{/*
Soft/hard pod anti-affinity presets, bitnami style.
Usage: include "strata.antiAffinity" (dict "preset" "soft" "labels" (include ...selectorLabels...))
*/}}
{{- define "strata.antiAffinity" -}}
{{- if eq .preset "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- .labels | nindent 12 }}
{{- else if eq .preset "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- .labels | nindent 10 }}
{{- end }}
{{- end -}}

{{/*
Where the TLS Secret's contents come from, first match wins: "existingSecret", "values" (tls.cert and tls.key),
"certManager" (a Certificate), "generated" (the chart's own CA and node certificate).
*/}}
{{- define "strata.tls.source" -}}
{{- if .Values.tls.existingSecret -}}existingSecret
{{- else if or .Values.tls.cert .Values.tls.key -}}values
{{- else if .Values.tls.certManager.enabled -}}certManager
{{- else -}}generated
{{- end -}}
{{- end -}}

{{/* "true" when the TLS Secret holds a ca.crt: every source but inline values without tls.ca. */}}
{{- define "strata.tls.hasCA" -}}
{{- if and .Values.tls.enabled (or (ne (include "strata.tls.source" .) "values") .Values.tls.ca) -}}true{{- end -}}
{{- end -}}

{{/* The names the node certificate covers: the coordinator Service, every stage worker, localhost. */}}
{{- define "strata.tls.dnsNames" -}}
{{- $ns := .Release.Namespace -}}
{{- $coordinator := include "strata.coordinator.fullname" . -}}
{{- $names := list $coordinator (printf "%s.%s" $coordinator $ns) (printf "%s.%s.svc" $coordinator $ns) (include "strata.coordinator.host" .) -}}
{{- $names = append $names (printf "*.%s.%s.svc.%s" (include "strata.stageWorker.headless" .) $ns .Values.clusterDomain) -}}
{{- $names = append $names "localhost" -}}
{{- concat $names .Values.tls.generated.extraDnsNames | toJson -}}
{{- end -}}

{{/* TLS env vars and mounts shared by coordinator, workers and the test pod. */}}
{{/*
STRATA_TLS_CA only when the Secret has a ca.crt (strata.tls.hasCA): the binaries refuse to start on a CA file that
is missing, rather than silently dropping mutual TLS.
*/}}
{{- define "strata.tls.env" -}}
{{- if .Values.tls.enabled }}
- name: STRATA_TLS_CERT
  value: {{ printf "%s/tls.crt" .Values.tls.mountPath | quote }}
- name: STRATA_TLS_KEY
  value: {{ printf "%s/tls.key" .Values.tls.mountPath | quote }}
{{- if include "strata.tls.hasCA" . }}
- name: STRATA_TLS_CA
  value: {{ printf "%s/ca.crt" .Values.tls.mountPath | quote }}
{{- end }}
{{- end }}
{{- end -}}
{{- define "strata.auth.env" -}}
{{- if .Values.auth.enabled }}
- name: STRATA_API_KEY_FILE
  value: {{ printf "%s/api-keys" .Values.auth.mountPath | quote }}
- name: STRATA_ADMIN_API_KEY_FILE
  value: {{ printf "%s/admin-api-keys" .Values.auth.mountPath | quote }}
{{- end }}
{{- end -}}
{{- define "strata.auth.volumeMount" -}}
{{- if .Values.auth.enabled }}
- name: api-keys
  mountPath: {{ .Values.auth.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}
{{- define "strata.auth.volume" -}}
{{- if .Values.auth.enabled }}
- name: api-keys
  secret:
    secretName: {{ include "strata.auth.secretName" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}
{{- define "strata.tls.volumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}
{{- define "strata.tls.volume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "strata.tls.secretName" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/*
Model volume. mode=pvc mounts a claim (ReadOnlyMany recommended), hostPath mounts a directory on the node,
initCopy copies from a source claim into an emptyDir before the worker starts.
Usage: include "strata.model.volume" (dict "ctx" $ "forCoordinator" true)
The coordinator only reads config and tokenizer files, so in initCopy mode it mounts the source claim directly.
*/}}
{{- define "strata.model.volume" -}}
{{- $v := .ctx.Values.model.volume -}}
- name: model
{{- if eq $v.mode "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.volume.pvc.claimName is required when model.volume.mode=pvc" $v.pvc.claimName }}
    readOnly: true
{{- else if eq $v.mode "hostPath" }}
  hostPath:
    path: {{ required "model.volume.hostPath.path is required when model.volume.mode=hostPath" $v.hostPath.path }}
    type: {{ $v.hostPath.type }}
{{- else if eq $v.mode "initCopy" }}
{{- if .forCoordinator }}
  persistentVolumeClaim:
    claimName: {{ required "model.volume.initCopy.sourceClaimName is required when model.volume.mode=initCopy" $v.initCopy.sourceClaimName }}
    readOnly: true
{{- else }}
  emptyDir:
    {{- if $v.initCopy.medium }}
    medium: {{ $v.initCopy.medium }}
    {{- end }}
    {{- if $v.initCopy.sizeLimit }}
    sizeLimit: {{ $v.initCopy.sizeLimit }}
    {{- end }}
- name: model-source
  persistentVolumeClaim:
    claimName: {{ required "model.volume.initCopy.sourceClaimName is required when model.volume.mode=initCopy" $v.initCopy.sourceClaimName }}
    readOnly: true
{{- end }}
{{- else }}
{{- fail (printf "model.volume.mode must be pvc, hostPath or initCopy (got %q)" $v.mode) }}
{{- end }}
{{- end -}}

{{- define "strata.model.volumeMount" -}}
{{- $v := .ctx.Values.model.volume -}}
- name: model
  mountPath: {{ .ctx.Values.model.mountPath }}
  {{- if and (eq $v.mode "pvc") $v.pvc.subPath }}
  subPath: {{ $v.pvc.subPath }}
  {{- else if and (eq $v.mode "initCopy") .forCoordinator $v.initCopy.sourceSubPath }}
  subPath: {{ $v.initCopy.sourceSubPath }}
  {{- end }}
  readOnly: true
{{- end -}}

{{/* Fail early on combinations the schema cannot express. */}}
{{- define "strata.validate" -}}
{{- if and .Values.tls.enabled (eq (include "strata.tls.source" .) "values") (not (and .Values.tls.cert .Values.tls.key)) -}}
{{- fail "tls.cert and tls.key go together: give both, or neither (then the chart generates a certificate)" -}}
{{- end -}}
{{- if and .Values.tls.enabled (eq (include "strata.tls.source" .) "certManager") (not .Values.tls.certManager.issuerRef.name) -}}
{{- fail "tls.certManager.enabled=true needs tls.certManager.issuerRef.name" -}}
{{- end -}}
{{- if and .Values.auth.adminCertIdentities (not (include "strata.tls.hasCA" .)) -}}
{{- fail "auth.adminCertIdentities need mutual TLS: tls.enabled=true with a CA" -}}
{{- end -}}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) (not (or .Values.auth.apiKeys .Values.auth.adminApiKeys)) -}}
{{- fail "auth.enabled=true needs auth.existingSecret, or keys in auth.apiKeys or auth.adminApiKeys" -}}
{{- end -}}
{{- include "strata.etcd.validate" . -}}
{{- if and (not .Values.etcd.external.endpoints) (not (has (int .Values.etcd.replicas) (list 1 3 5))) -}}
{{- fail "etcd.replicas must be 1, 3 or 5" -}}
{{- end -}}
{{- if and .Values.stageWorker.gpu.enabled (hasPrefix "cpu" .Values.stageWorker.device) -}}
{{- fail "stageWorker.device=cpu with stageWorker.gpu.enabled=true would reserve GPUs it never uses; set gpu.enabled=false" -}}
{{- end -}}
{{- if and (not .Values.stageWorker.gpu.enabled) (hasPrefix "cuda" .Values.stageWorker.device) -}}
{{- fail "stageWorker.device=cuda:N needs stageWorker.gpu.enabled=true" -}}
{{- end -}}
{{- if and (hasPrefix "cuda" .Values.stageWorker.device) (ne .Values.stageWorker.cpuIsa "auto") -}}
{{- fail "stageWorker.cpuIsa applies to the cpu device; leave it auto with stageWorker.device=cuda:N" -}}
{{- end -}}
{{- end -}}
