{{/*
etcd TLS and auth, shared by the coordinator, the stage workers, the bundled etcd and its enable-auth Job. The
binaries read STRATA_ETCD_CA, STRATA_ETCD_CERT, STRATA_ETCD_KEY, STRATA_ETCD_USER and STRATA_ETCD_PASSWORD_FILE.
*/}}
{{- define "strata.etcd.tlsSecretName" -}}
{{- default (printf "%s-etcd-tls" (include "strata.fullname" .)) .Values.etcd.tls.existingSecret -}}
{{- end -}}
{{- define "strata.etcd.authSecretName" -}}
{{- default (printf "%s-etcd-auth" (include "strata.fullname" .)) .Values.etcd.auth.existingSecret -}}
{{- end -}}
{{/*
A client certificate is presented when the Secret has one: always with the bundled etcd (it requires client
certificates and serves with the same tls.crt), with an external etcd when etcd.tls.cert was given or an existing
Secret is used (which must then hold tls.crt and tls.key).
*/}}
{{- define "strata.etcd.clientCert" -}}
{{- if or (not .Values.etcd.external.endpoints) .Values.etcd.tls.cert .Values.etcd.tls.existingSecret -}}true{{- end -}}
{{- end -}}
{{- define "strata.etcd.env" -}}
{{- if .Values.etcd.tls.enabled }}
- name: STRATA_ETCD_CA
  value: {{ printf "%s/ca.crt" .Values.etcd.tls.mountPath | quote }}
{{- if include "strata.etcd.clientCert" . }}
- name: STRATA_ETCD_CERT
  value: {{ printf "%s/tls.crt" .Values.etcd.tls.mountPath | quote }}
- name: STRATA_ETCD_KEY
  value: {{ printf "%s/tls.key" .Values.etcd.tls.mountPath | quote }}
{{- end }}
{{- end }}
{{- if .Values.etcd.auth.enabled }}
- name: STRATA_ETCD_USER
  value: {{ .Values.etcd.auth.user | quote }}
- name: STRATA_ETCD_PASSWORD_FILE
  value: {{ printf "%s/password" .Values.etcd.auth.mountPath | quote }}
{{- end }}
{{- end -}}
{{- define "strata.etcd.volumeMount" -}}
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  mountPath: {{ .Values.etcd.tls.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.etcd.auth.enabled }}
- name: etcd-auth
  mountPath: {{ .Values.etcd.auth.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}
{{- define "strata.etcd.volume" -}}
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  secret:
    secretName: {{ include "strata.etcd.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- if .Values.etcd.auth.enabled }}
- name: etcd-auth
  secret:
    secretName: {{ include "strata.etcd.authSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* Fail early on etcd security settings the schema cannot express. */}}
{{- define "strata.etcd.validate" -}}
{{- $tls := .Values.etcd.tls -}}
{{- $external := .Values.etcd.external.endpoints -}}
{{- if and $tls.enabled (not $tls.existingSecret) (not $tls.ca) -}}
{{- fail "etcd.tls.enabled=true needs etcd.tls.existingSecret, or etcd.tls.ca" -}}
{{- end -}}
{{- if and $tls.enabled (not $tls.existingSecret) (not $external) (not (and $tls.cert $tls.key)) -}}
{{- fail "etcd.tls.enabled=true with the bundled etcd needs etcd.tls.cert and etcd.tls.key (it serves with them)" -}}
{{- end -}}
{{- if ne (empty $tls.cert) (empty $tls.key) -}}
{{- fail "etcd.tls.cert and etcd.tls.key go together" -}}
{{- end -}}
{{- range $external }}
{{- if and $tls.enabled (hasPrefix "http://" .) -}}
{{- fail (printf "etcd.tls.enabled=true but etcd.external.endpoints has plaintext %s: use https://" .) -}}
{{- end -}}
{{- if and (not $tls.enabled) (hasPrefix "https://" .) -}}
{{- fail (printf "etcd.external.endpoints has %s: https needs etcd.tls.enabled=true and the CA that signs etcd's certificate" .) -}}
{{- end -}}
{{- end }}
{{- if and .Values.etcd.auth.enabled (not .Values.etcd.auth.existingSecret) (not .Values.etcd.auth.password) -}}
{{- fail "etcd.auth.enabled=true needs etcd.auth.existingSecret, or etcd.auth.password" -}}
{{- end -}}
{{- if and .Values.etcd.auth.enabled (not $external) (ne .Values.etcd.auth.user "root") -}}
{{- fail "etcd.auth.user must be root with the bundled etcd: etcd enables auth only for root" -}}
{{- end -}}
{{- end -}}
