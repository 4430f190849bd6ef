{{/* Names and labels shared by every object of the chart. */}}

{{- define "shardcache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "shardcache.fullname" -}}
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

{{- define "shardcache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shardcache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "shardcache.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "shardcache.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: node-cache
{{- end }}

{{- define "shardcache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "shardcache.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The headless Service: its name resolves to every daemon pod (peer discovery). */}}
{{- define "shardcache.serviceName" -}}
{{- include "shardcache.fullname" . }}
{{- end }}

{{/* The daemon's peer_dns: the Service's fully qualified name and the peer port. */}}
{{- define "shardcache.peerDns" -}}
{{- printf "%s.%s.svc.%s:%d" (include "shardcache.serviceName" .) .Release.Namespace .Values.peers.clusterDomain (int .Values.peers.port) }}
{{- end }}

{{- define "shardcache.secretName" -}}
{{- if .Values.peers.secret.existingSecret }}
{{- .Values.peers.secret.existingSecret }}
{{- else }}
{{- printf "%s-peer-secret" (include "shardcache.fullname" .) }}
{{- end }}
{{- end }}

{{- define "shardcache.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Where things are inside the daemon's container. */}}
{{- define "shardcache.configPath" -}}/etc/shardcache/shardcached.toml{{- end }}
{{- /* Not under /etc/shardcache: a mount inside the read-only ConfigMap volume can fail. */}}
{{- define "shardcache.secretDir" -}}/etc/shardcache-peer{{- end }}
{{- define "shardcache.tlsDir" -}}/etc/shardcache-peer-tls{{- end }}
{{- define "shardcache.cachePath" -}}/var/cache/shardcache{{- end }}
{{- define "shardcache.socketDirPath" -}}/run/shardcache{{- end }}

{{/*
One TOML value from a values entry: strings as TOML basic strings (JSON escapes are
valid TOML), whole numbers as integers, booleans as booleans. Anything else is refused.
*/}}
{{- define "shardcache.tomlValue" -}}
{{- $v := . }}
{{- if kindIs "string" $v }}
{{- toJson $v }}
{{- else if kindIs "bool" $v }}
{{- ternary "true" "false" $v }}
{{- else if or (kindIs "int" $v) (kindIs "int64" $v) }}
{{- $v }}
{{- else if kindIs "float64" $v }}
{{- if ne (float64 (int64 $v)) $v }}
{{- fail (printf "config: %v is not a whole number (write fractions as strings, e.g. \"1.5GiB\")" $v) }}
{{- end }}
{{- int64 $v }}
{{- else }}
{{- fail (printf "config: %v (a %s) is neither a string, a whole number nor a boolean" $v (kindOf $v)) }}
{{- end }}
{{- end }}
