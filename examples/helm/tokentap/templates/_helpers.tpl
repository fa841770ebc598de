{{/* Names and labels. */}}
{{- define "tokentap.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tokentap.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tokentap.labels" -}}
{{ include "tokentap.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tokentap.adminTokenSecret" -}}
{{- if .Values.adminToken.existingSecret -}}
{{ .Values.adminToken.existingSecret }}
{{- else if .Values.adminToken.value -}}
{{ include "tokentap.fullname" . }}-admin
{{- end -}}
{{- end -}}

{{/*
The config file: the user's config with what the chart owns set over it
(the listeners, the drain, the token, TLS, Redis, OTel).
*/}}
{{- define "tokentap.config" -}}
{{- $c := deepCopy (.Values.config | default dict) -}}
{{- if not (or (hasKey $c "routes") (hasKey $c "upstream")) -}}
{{- $_ := set $c "upstream" .Values.upstream -}}
{{- end -}}
{{- $_ := set $c "listen" (printf ":%d" (int .Values.service.port)) -}}
{{- $admin := dict "listen" (printf ":%d" (int .Values.service.adminPort)) -}}
{{- if include "tokentap.adminTokenSecret" . -}}
{{- $_ := set $admin "token_file" "/etc/tokentap/admin/token" -}}
{{- end -}}
{{- $_ := set $c "admin" $admin -}}
{{- $_ := set $c "drain_timeout" (printf "%ds" (int .Values.drain.timeoutSeconds)) -}}
{{- if .Values.drain.preStopSleep -}}
{{- $_ := set $c "drain_delay" "0s" -}}
{{- else -}}
{{- $_ := set $c "drain_delay" (printf "%ds" (int .Values.drain.delaySeconds)) -}}
{{- end -}}
{{- if .Values.tls.secretName -}}
{{- $tls := dict "cert_file" "/etc/tokentap/tls/tls.crt" "key_file" "/etc/tokentap/tls/tls.key" "min_version" (.Values.tls.minVersion | toString) -}}
{{- if .Values.tls.clientCA -}}
{{- $_ := set $tls "client_ca_file" "/etc/tokentap/tls/ca.crt" -}}
{{- end -}}
{{- $_ := set $c "tls" $tls -}}
{{- end -}}
{{- if .Values.redis.addr -}}
{{- $adm := deepCopy (get $c "admission" | default dict) -}}
{{- $r := dict "addr" .Values.redis.addr -}}
{{- if .Values.redis.passwordSecret -}}
{{- $_ := set $r "password_file" "/etc/tokentap/redis/password" -}}
{{- end -}}
{{- $_ := set $adm "store" (dict "redis" $r "fail" .Values.redis.fail) -}}
{{- $_ := set $c "admission" $adm -}}
{{- end -}}
{{- if .Values.otel.endpoint -}}
{{- $_ := set $c "otel" (dict "endpoint" .Values.otel.endpoint "service_name" (include "tokentap.fullname" .) "traces" .Values.otel.traces "metrics" .Values.otel.metrics "sample" .Values.otel.sample) -}}
{{- end -}}
{{- toYaml $c -}}
{{- end -}}
