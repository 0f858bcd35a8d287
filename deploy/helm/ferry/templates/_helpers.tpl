{{/*
Helpers of the ferry chart: names, labels, images and the database Secret of
each role. Everything that more than one template needs lives here.
*/}}

{{/* The chart's name (nameOverride wins). */}}
{{- define "ferry.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: fullnameOverride, else the release name,
followed by the chart name unless the release name already contains it.
Kept to 50 characters so that suffixes such as "-projection" fit in 63.
*/}}
{{- define "ferry.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of every resource. */}}
{{- define "ferry.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ferry
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{/*
Selector labels of one component; call with (list $ "component").
*/}}
{{- define "ferry.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "ferry.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/*
The roles of database.roles whose login a pod of this release uses, space
separated: the consumer's with projection.enabled, the console's with
console.enabled.
*/}}
{{- define "ferry.rolesInUse" -}}
service relay migrate
{{- if .Values.projection.enabled }} consumer{{ end }}
{{- if .Values.console.enabled }} console{{ end }}
{{- end }}

{{/* An image reference from images.<which>; call with (list $ "relay"). */}}
{{- define "ferry.image" -}}
{{- $ := index . 0 -}}
{{- $img := index $.Values.images (index . 1) }}
{{- printf "%s:%s" $img.repository (default $.Chart.AppVersion $img.tag) }}
{{- end }}

{{/*
The Secret name holding a role's database URL: the existing one, or the one
the chart makes. Fails when the role has neither a URL nor an existing
Secret. Call with (list $ "relay").
*/}}
{{- define "ferry.dbSecretName" -}}
{{- $ := index . 0 -}}
{{- $role := index . 1 }}
{{- $r := index $.Values.database.roles $role }}
{{- if $r.existingSecret }}
{{- $r.existingSecret }}
{{- else if $r.url }}
{{- printf "%s-db-%s" (include "ferry.fullname" $) $role }}
{{- else }}
{{- fail (printf "database.roles.%s: give url or existingSecret" $role) }}
{{- end }}
{{- end }}

{{/* The key of a role's URL in its Secret; call with (list $ "relay"). */}}
{{- define "ferry.dbSecretKey" -}}
{{- $r := index (index . 0).Values.database.roles (index . 1) }}
{{- if $r.existingSecret }}{{ $r.existingSecretKey }}{{ else }}url{{ end }}
{{- end }}

{{/* The DATABASE_URL env entry of a role; call with (list $ "relay"). */}}
{{- define "ferry.databaseUrlEnv" -}}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "ferry.dbSecretName" . }}
      key: {{ include "ferry.dbSecretKey" . }}
{{- end }}

{{/* The OTLP endpoint env entry, when one is set. */}}
{{- define "ferry.otlpEnv" -}}
{{- if .Values.otlpEndpoint -}}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.otlpEndpoint | quote }}
{{- end }}
{{- end }}

{{/* The pod security context of every pod. */}}
{{- define "ferry.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.runAsUser }}
{{- end }}

{{/* The container security context of every container. */}}
{{- define "ferry.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end }}

{{/*
The relay sidecar's arguments: `run` and one --flag=value per set value.
Every flag is one `ferry-relay run --help` lists; scripts/check-helm parses
the rendered list with the relay binary.
*/}}
{{- define "ferry.relayArgs" -}}
{{- $r := .Values.relay -}}
- run
- {{ printf "--listen=0.0.0.0:%d" (int $r.port) | quote }}
- {{ printf "--brokers=%s" .Values.kafka.brokers | quote }}
{{- if ne $r.capture "auto" }}
- {{ printf "--capture=%s" $r.capture | quote }}
{{- end }}
{{- with $r.slot }}
- {{ printf "--slot=%s" . | quote }}
{{- end }}
{{- with $r.publication }}
- {{ printf "--publication=%s" . | quote }}
{{- end }}
{{- if gt (int $r.streams) 1 }}
- {{ printf "--streams=%d" (int $r.streams) | quote }}
{{- end }}
{{- if $r.exactlyOnce }}
- --exactly-once
{{- end }}
{{- with $r.transactionalIdPrefix }}
- {{ printf "--transactional-id-prefix=%s" . | quote }}
{{- end }}
{{- with $r.progressTopic }}
- {{ printf "--progress-topic=%s" . | quote }}
{{- end }}
{{- if $r.deleteOnDelivery }}
- --delete-on-delivery
{{- end }}
{{- range $k, $v := $r.librdkafka }}
- {{ printf "--kafka=%s=%v" $k $v | quote }}
{{- end }}
- {{ printf "--topic-template=%s" $r.topicTemplate | quote }}
- {{ printf "--on-poison=%s" $r.onPoison | quote }}
- {{ printf "--batch-size=%d" (int $r.batchSize) | quote }}
- {{ printf "--lease=%s" $r.lease | quote }}
- {{ printf "--grace=%ds" (int $r.graceSeconds) | quote }}
{{- with $r.pollInterval }}
- {{ printf "--poll-interval=%s" . | quote }}
{{- end }}
{{- with $r.retention }}
- {{ printf "--retention=%s" . | quote }}
{{- end }}
{{- with $r.compression }}
- {{ printf "--compression=%s" . | quote }}
{{- end }}
{{- with $r.maxLanes }}
- {{ printf "--max-lanes=%d" (int .) | quote }}
{{- end }}
{{- end }}
