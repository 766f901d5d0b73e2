{{/*
Names and labels. Every label on every object comes from these helpers; no template writes an
app.kubernetes.io/* label by hand.

The release has several components (operator, router, replica, redis). Each is its own
application in the sense of app.kubernetes.io/name ("kvfleet-router", ...), so that every
selector is exactly {app.kubernetes.io/name, app.kubernetes.io/instance}: two labels that never
change over a release's life (a selector is immutable), and that still tell the router's pods
from the replicas'. app.kubernetes.io/component and app.kubernetes.io/part-of say the same for
humans and dashboards; they are never used in a selector.

Helpers that concern one component take a dict: (dict "context" $ "component" "router").
*/}}

{{/* The chart's name, or nameOverride. */}}
{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The release's base name for objects: fullnameOverride, else the release name when it already
contains the chart's name, else "<release>-<chart>". Truncated to 63 characters (DNS label).
*/}}
{{- define "kvfleet.fullname" -}}
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

{{/* "<chart>-<version>" for the helm.sh/chart label. */}}
{{- define "kvfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* A component's object name: "<fullname>-<component>". */}}
{{- define "kvfleet.componentFullname" -}}
{{- printf "%s-%s" (include "kvfleet.fullname" .context) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* A component's application name, the value of app.kubernetes.io/name. */}}
{{- define "kvfleet.componentName" -}}
{{- printf "%s-%s" (include "kvfleet.name" .context) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels: name and instance, nothing else. Immutable over a release's life. */}}
{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfleet.componentName" . }}
app.kubernetes.io/instance: {{ .context.Release.Name }}
{{- end -}}

{{/* The standard labels of every object of a component (and of its pod template). */}}
{{- define "kvfleet.labels" -}}
{{ include "kvfleet.selectorLabels" . }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/part-of: {{ include "kvfleet.name" .context }}
app.kubernetes.io/version: {{ .context.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .context.Release.Service }}
helm.sh/chart: {{ include "kvfleet.chart" .context }}
{{- with .context.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
An image reference from {registry, repository, tag, digest}: a digest wins over a tag; an empty
tag means the chart's appVersion.
*/}}
{{- define "kvfleet.image" -}}
{{- $repo := .image.repository -}}
{{- if .image.registry -}}
{{- $repo = printf "%s/%s" .image.registry .image.repository -}}
{{- end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repo .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .context.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "kvfleet.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "kvfleet.componentFullname" (dict "context" . "component" "operator")) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The ConfigMap the operator publishes the fleet config in, and router and replicas mount. */}}
{{- define "kvfleet.fleetConfigMapName" -}}
{{- default (printf "%s-fleet" (include "kvfleet.fullname" .)) .Values.fleetConfig.configMapName | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The Secret holding the peer-transfer shared secret (chart-made unless existingSecret). */}}
{{- define "kvfleet.peerSecretName" -}}
{{- default (printf "%s-peer" (include "kvfleet.fullname" .)) .Values.peerTransfer.existingSecret -}}
{{- end -}}

{{/* The Secret holding the router's API-key -> tenant file (chart-made unless existingSecret). */}}
{{- define "kvfleet.routerKeysSecretName" -}}
{{- default (printf "%s-router-keys" (include "kvfleet.fullname" .)) .Values.router.apiKeys.existingSecret -}}
{{- end -}}

{{/* The Secret holding the router secret and the operator token (chart-made unless existingSecret). */}}
{{- define "kvfleet.authSecretName" -}}
{{- default (printf "%s-auth" (include "kvfleet.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The Secret holding the bundled Redis' password (chart-made unless existingSecret). */}}
{{- define "kvfleet.redisSecretName" -}}
{{- default (printf "%s-redis" (include "kvfleet.fullname" .)) .Values.redis.bundled.auth.existingSecret -}}
{{- end -}}

{{/* "true" when a Redis (bundled or external) is configured, else "". */}}
{{- define "kvfleet.redis.configured" -}}
{{- if or .Values.redis.bundled.enabled .Values.redis.external.url .Values.redis.external.existingSecret -}}
true
{{- end -}}
{{- end -}}

{{/*
The Redis URL as the environment variable KVFLEET_REDIS_URL, which the router and the replicas
(`dict "context" . "role" "router"|"replica"`)
read from their environment (never from argv, where a password would show in the process list): the bundled Redis' Service, an
external URL, or a key of an existing Secret (a URL with a password stays out of the pod spec).
Nothing when no Redis is configured (the runtime then keeps an in-process hint index).
*/}}
{{- define "kvfleet.redisUrlEnv" -}}
{{- $ctx := .context -}}
{{- $b := $ctx.Values.redis.bundled -}}
{{- if $ctx.Values.redis.cluster.seedUrls -}}
{{- include "kvfleet.redisClusterEnv" $ctx -}}
{{- else if and $b.enabled $b.auth.enabled -}}
{{- /* The password from its Secret, into the URL by the kubelet's $(VAR) expansion: it never
appears in the pod spec. With roleUsers, the role's own ACL user and password. */}}
- name: KVFLEET_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvfleet.redisSecretName" $ctx }}
      key: {{ ternary (get $b.auth (printf "%sPasswordKey" .role)) $b.auth.secretKey (and $b.auth.roleUsers true) }}
- name: KVFLEET_REDIS_URL
  value: {{ printf "redis://%s:$(KVFLEET_REDIS_PASSWORD)@%s:%d/0" (ternary (printf "kvfleet-%s" .role) "" (and $b.auth.roleUsers true)) (include "kvfleet.componentFullname" (dict "context" $ctx "component" "redis")) (int $b.port) | quote }}
{{- else if $b.enabled -}}
- name: KVFLEET_REDIS_URL
  value: {{ printf "redis://%s:%d/0" (include "kvfleet.componentFullname" (dict "context" $ctx "component" "redis")) (int $b.port) | quote }}
{{- else if $ctx.Values.redis.external.existingSecret -}}
- name: KVFLEET_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $ctx.Values.redis.external.existingSecret }}
      key: {{ $ctx.Values.redis.external.secretKey }}
{{- else if $ctx.Values.redis.external.url -}}
- name: KVFLEET_REDIS_URL
  value: {{ $ctx.Values.redis.external.url | quote }}
{{- end -}}
{{- end -}}

{{/*
The ACL rules of a role's Redis user (after `user <name> on ><password>`): a copy of
kvfleet_runtime.fleet.hint_index.ACL_RULES, checked equal by tests/chart/test_sources_of_truth.py.
*/}}
{{- define "kvfleet.redisAclRules" -}}
{{- if eq . "replica" -}}
resetkeys ~kvfleet:* resetchannels -@all +@connection +evalsha +eval +script|load +zadd +zrem +expire +zrangebyscore +set +get +cluster|slots +cluster|shards +readonly
{{- else if eq . "router" -}}
resetkeys ~kvfleet:* resetchannels -@all +@connection +evalsha +eval +script|load +zrangebyscore +get +cluster|slots +cluster|shards +readonly
{{- else -}}
{{- fail (printf "no Redis ACL role %q" .) -}}
{{- end -}}
{{- end -}}

{{/*
A Redis Cluster's seed URLs as KVFLEET_REDIS_CLUSTER_URLS (replicas and routers read it), with the
cluster's password from its Secret put into each URL by the kubelet's $(VAR) expansion.
*/}}
{{- define "kvfleet.redisClusterEnv" -}}
{{- $auth := .Values.redis.cluster.auth -}}
{{- if $auth.existingSecret }}
- name: KVFLEET_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $auth.existingSecret }}
      key: {{ $auth.secretKey }}
{{- end }}
{{- $urls := list -}}
{{- range .Values.redis.cluster.seedUrls -}}
{{- $urls = append $urls (ternary (regexReplaceAll "^(rediss?://)" . "${1}:$(KVFLEET_REDIS_PASSWORD)@") . (not (empty $auth.existingSecret))) -}}
{{- end }}
- name: KVFLEET_REDIS_CLUSTER_URLS
  value: {{ join "," $urls | quote }}
{{- end -}}

{{/* Whether the monitoring.coreos.com objects are rendered: create=always, or auto and the API exists. */}}
{{- define "kvfleet.monitoring.serviceMonitor" -}}
{{- if or (eq .Values.monitoring.create "always") (and (eq .Values.monitoring.create "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/ServiceMonitor")) -}}
true
{{- end -}}
{{- end -}}

{{- define "kvfleet.monitoring.prometheusRule" -}}
{{- if or (eq .Values.monitoring.create "always") (and (eq .Values.monitoring.create "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1/PrometheusRule")) -}}
true
{{- end -}}
{{- end -}}

{{/* The components whose Services the ServiceMonitor scrapes (those serving /metrics on "http"). */}}
{{- define "kvfleet.monitoring.scrapedComponents" -}}
{{- $out := list -}}
{{- if .Values.replica.enabled -}}{{- $out = append $out "replica" -}}{{- end -}}
{{- if .Values.router.enabled -}}{{- $out = append $out "router" -}}{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
The ServiceMonitor's Service selector: this release's instance label, and a name among the scraped
components' (a label selector cannot say "one of several names" with matchLabels alone).
*/}}
{{- define "kvfleet.monitoring.selector" -}}
matchLabels:
  app.kubernetes.io/instance: {{ .Release.Name }}
matchExpressions:
  - key: app.kubernetes.io/name
    operator: In
    values:
      {{- range (include "kvfleet.monitoring.scrapedComponents" . | fromYamlArray) }}
      - {{ include "kvfleet.componentName" (dict "context" $ "component" .) }}
      {{- end }}
{{- end -}}
