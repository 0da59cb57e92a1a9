{{/*
Sluice chart helpers.

One release is one site.  "sluice.site" builds the site file every pod reads
(the `site` or `siteFile` value, with the `kafka` values merged into its
kafka: section); the workload helpers turn one service's settings into a
Deployment or StatefulSet.  A service's settings are `serviceDefaults`, then
the service's own block, then (senders and dispatchers) its entry in `byId`,
each merged over the one before.
*/}}

{{- define "sluice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sluice.fullname" -}}
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

{{- define "sluice.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sluice.labels" -}}
helm.sh/chart: {{ include "sluice.chart" . }}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sluice
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sluice.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The site file as a YAML text.  Helm reads values as JSON-like data, so the
keys come out sorted; `sluice config check` in every pod's init step (and in
the chart's tests) is what decides whether the file is valid.
*/}}
{{- define "sluice.site" -}}
{{- $site := dict }}
{{- if .Values.siteFile }}
{{- $site = fromYaml .Values.siteFile }}
{{- if hasKey $site "Error" }}
{{- fail (printf "siteFile: not a YAML mapping of site settings: %s" (get $site "Error")) }}
{{- end }}
{{- else }}
{{- $site = deepCopy (default dict .Values.site) }}
{{- end }}
{{- if not $site }}
{{- fail "site: the site file is empty: give it as `site:` (a mapping, like deploy/sites/site-a.yaml) or as `siteFile` (its text, e.g. --set-file siteFile=deploy/sites/site-a.yaml)" }}
{{- end }}
{{- $kafka := deepCopy (default dict (get $site "kafka")) }}
{{- $kafka = mergeOverwrite $kafka (deepCopy (default dict .Values.kafka.settings)) }}
{{- with .Values.kafka.bootstrapServers }}
{{- if not (regexMatch "^[^,\\s]+:[0-9]{1,5}(,[^,\\s]+:[0-9]{1,5})*$" .) }}
{{- fail (printf "kafka.bootstrapServers: %q is not host:port[,host:port] (e.g. kafka-kafka-bootstrap.kafka.svc:9093)" .) }}
{{- end }}
{{- $_ := set $kafka "bootstrap_servers" . }}
{{- end }}
{{- if not (get $kafka "bootstrap_servers") }}
{{- fail "kafka.bootstrapServers: no Kafka bootstrap servers: set kafka.bootstrapServers (e.g. my-cluster-kafka-bootstrap:9093) or kafka.bootstrap_servers in the site file" }}
{{- end }}
{{- $_ := set $site "kafka" $kafka }}
{{- /*
Helm's values are JSON underneath, so a map key is always a string: the
dsids of receiver.sender_keys would come out quoted ("2":), which the site
file's strict model refuses.  Keys that are whole numbers are written bare.
*/}}
{{- regexReplaceAll "(?m)^(\\s*)\"([0-9]+)\":" (toYaml $site) "${1}${2}:" }}
{{- end }}

{{/* The site file as a dict. */}}
{{- define "sluice.siteDict" -}}
{{- include "sluice.site" . | fromYaml | toJson }}
{{- end }}

{{/* The region service's port: region_service.port of the site file, else the model's default 7070. */}}
{{- define "sluice.regionPort" -}}
{{- $site := include "sluice.siteDict" . | fromJson }}
{{- $rs := default dict (get $site "region_service") }}
{{- if and (hasKey $rs "port") (eq (int (get $rs "port")) 0) }}
{{- fail "site: region_service.port is 0 (any free port); the region Service needs a fixed port: set region_service.port in the site file, or leave it out for 7070" }}
{{- end }}
{{- int (default 7070 (get $rs "port")) }}
{{- end }}

{{/*
A workload's name, "<fullname>-<component>" or "<fullname>-<component>-<id>",
made a DNS-1123 label (it is also a label value): queue ids may hold
capitals and '_' and run to 101 characters, and a long release name leaves
little room.  A name that had to be changed gets a hash of what it was, so
two ids never map to the same name.
Arguments: (list root component id), id "" for a service without ids.
*/}}
{{- define "sluice.workloadName" -}}
{{- $root := index . 0 }}
{{- $plain := printf "%s-%s" (include "sluice.fullname" $root) (index . 1) }}
{{- with index . 2 }}
{{- $plain = printf "%s-%s" $plain . }}
{{- end }}
{{- if regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" $plain }}
{{- $plain }}
{{- else }}
{{- printf "%s-%s" (regexReplaceAll "-+$" ($plain | lower | replace "_" "-" | trunc 54) "") (sha256sum $plain | trunc 8) }}
{{- end }}
{{- end }}

{{/*
One service's settings: serviceDefaults, then the service's block (without
its byId), then the byId entry, each merged over the one before.
Arguments: (list root serviceKey id), id "" for services without ids.
*/}}
{{- define "sluice.settings" -}}
{{- $root := index . 0 }}
{{- $key := index . 1 }}
{{- $id := index . 2 }}
{{- $settings := deepCopy $root.Values.serviceDefaults }}
{{- $block := omit (deepCopy (get $root.Values $key)) "byId" }}
{{- $settings = mergeOverwrite $settings $block }}
{{- if $id }}
{{- $byId := default dict (get (get $root.Values $key) "byId") }}
{{- $settings = mergeOverwrite $settings (deepCopy (default dict (get $byId $id))) }}
{{- end }}
{{- toJson $settings }}
{{- end }}

{{- define "sluice.probe" -}}
{{- $probe := index . 0 }}
{{- $path := index . 1 }}
httpGet:
  path: {{ $path }}
  port: metrics
initialDelaySeconds: {{ $probe.initialDelaySeconds | default 0 }}
periodSeconds: {{ $probe.periodSeconds }}
timeoutSeconds: {{ $probe.timeoutSeconds }}
failureThreshold: {{ $probe.failureThreshold }}
{{- end }}

{{/*
The volumes every Sluice pod has (arguments: root, the site file's
ConfigMap or Secret): the site file, the Kafka TLS/SASL
material (when kafka.secrets names any), a writable work folder and /tmp
(the root filesystem is read-only), and extraVolumes.
*/}}
{{- define "sluice.volumes" -}}
{{- $siteName := index . 1 }}
{{- with index . 0 }}
- name: site
  {{- if eq .Values.siteFileStorage "Secret" }}
  secret:
    secretName: {{ $siteName }}
    defaultMode: 0440
  {{- else }}
  configMap:
    name: {{ $siteName }}
  {{- end }}
{{- if .Values.kafka.secrets }}
- name: kafka-secrets
  projected:
    defaultMode: 0440
    sources:
    {{- range .Values.kafka.secrets }}
      - secret:
          name: {{ .name }}
          {{- with .items }}
          items:
            {{- toYaml . | nindent 12 }}
          {{- end }}
    {{- end }}
{{- end }}
- name: work
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sluice.volumeMounts" -}}
- name: site
  mountPath: {{ .Values.siteMountPath }}
  readOnly: true
{{- if .Values.kafka.secrets }}
- name: kafka-secrets
  mountPath: {{ .Values.kafka.secretMountPath }}
  readOnly: true
{{- end }}
- name: work
  mountPath: /var/lib/sluice
- name: tmp
  mountPath: /tmp
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* secretEnv as container env entries (secretKeyRef), for the site file's *_env secrets. */}}
{{- define "sluice.secretEnv" -}}
{{- range .Values.secretEnv }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secret }}
      key: {{ .key }}
      {{- if hasKey . "optional" }}
      optional: {{ .optional }}
      {{- end }}
{{- end }}
{{- end }}

{{- define "sluice.siteFilePath" -}}
{{- printf "%s/site.yaml" (.Values.siteMountPath | trimSuffix "/") }}
{{- end }}

{{/*
A Deployment or StatefulSet running one Sluice service.
Arguments (a dict):
  root       the chart's context
  name       the workload's name
  component  region, sender, receiver, dispatcher, subscriptions
  kind       Deployment or StatefulSet
  settings   the merged settings (see "sluice.settings")
  args       the `sluice` arguments after the entry point
  ports      extra container ports (a list of dicts), or nil
  queueId    the sender or queue id, or ""
  serviceName  a StatefulSet's headless Service
*/}}
{{- define "sluice.workload" -}}
{{- $root := .root }}
{{- $s := .settings }}
{{- $site := include "sluice.siteDict" $root | fromJson }}
{{- $selector := dict "app.kubernetes.io/component" .component "sluice/workload" .name }}
apiVersion: apps/v1
kind: {{ .kind }}
metadata:
  name: {{ .name }}
  labels:
    {{- include "sluice.labels" $root | nindent 4 }}
    {{- toYaml $selector | nindent 4 }}
  {{- if .queueId }}
  annotations:
    sluice/queue-id: {{ .queueId | quote }}
  {{- end }}
spec:
  replicas: {{ $s.replicas }}
  {{- if eq .kind "StatefulSet" }}
  serviceName: {{ .serviceName }}
  # State lives in Kafka: instances need no ordered start, and a new one
  # recovers its buckets from the changelog.
  podManagementPolicy: Parallel
  {{- else }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxUnavailable: 0
      maxSurge: 1
  {{- end }}
  revisionHistoryLimit: {{ $root.Values.revisionHistoryLimit }}
  selector:
    matchLabels:
      {{- include "sluice.selectorLabels" $root | nindent 6 }}
      {{- toYaml $selector | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "sluice.labels" $root | nindent 8 }}
        {{- toYaml $selector | nindent 8 }}
      annotations:
        checksum/site: {{ include "sluice.site" $root | sha256sum }}
        {{- if $root.Values.health.prometheusScrape }}
        prometheus.io/scrape: "true"
        prometheus.io/port: {{ $root.Values.health.port | quote }}
        prometheus.io/path: {{ $root.Values.health.metricsPath | quote }}
        {{- end }}
        {{- with .queueId }}
        sluice/queue-id: {{ . | quote }}
        {{- end }}
        {{- with $s.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "sluice.serviceAccountName" $root }}
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $s.terminationGracePeriodSeconds }}
      {{- with $s.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $s.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if ne $s.antiAffinity "none" }}
      affinity:
        podAntiAffinity:
          {{- $term := dict "topologyKey" $s.antiAffinityTopologyKey "labelSelector" (dict "matchLabels" (merge (include "sluice.selectorLabels" $root | fromYaml) $selector)) }}
          {{- if eq $s.antiAffinity "hard" }}
          requiredDuringSchedulingIgnoredDuringExecution:
            - {{- toYaml $term | nindent 14 }}
          {{- else }}
          preferredDuringSchedulingIgnoredDuringExecution:
            - weight: 100
              podAffinityTerm:
                {{- toYaml $term | nindent 16 }}
          {{- end }}
      {{- end }}
      initContainers:
        # The site file is checked before the service starts: a bad one
        # stops here with every problem listed (`kubectl logs POD -c config-check`).
        - name: config-check
          image: {{ include "sluice.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args: ["config", "check", {{ include "sluice.siteFilePath" $root | quote }}]
          {{- with $root.Values.secretEnv }}
          env:
            {{- include "sluice.secretEnv" $root | nindent 12 }}
          {{- end }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          resources:
            {{- toYaml $root.Values.configCheck.resources | nindent 12 }}
          volumeMounts:
            {{- include "sluice.volumeMounts" $root | nindent 12 }}
      containers:
        - name: {{ .component }}
          image: {{ include "sluice.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            {{- range .args }}
            - {{ . | quote }}
            {{- end }}
            {{- range $s.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: POD_NAMESPACE
              valueFrom:
                fieldRef:
                  fieldPath: metadata.namespace
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: {{ $root.Values.health.portEnv }}
              value: {{ $root.Values.health.port | quote }}
            - name: OTEL_SERVICE_NAME
              value: {{ printf "sluice-%s" .component | quote }}
            - name: OTEL_RESOURCE_ATTRIBUTES
              value: {{ printf "sluice.site=%s,sluice.dsid=%v,k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME)" (get $site "site") (get $site "dsid") | quote }}
            {{- include "sluice.secretEnv" $root | nindent 12 }}
            {{- with $s.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            {{- range .ports }}
            - name: {{ .name }}
              containerPort: {{ .containerPort }}
              protocol: TCP
            {{- end }}
            - name: metrics
              containerPort: {{ $root.Values.health.port }}
              protocol: TCP
          {{- if $s.probes.startup.enabled }}
          startupProbe:
            {{- include "sluice.probe" (list $s.probes.startup $root.Values.health.livenessPath) | nindent 12 }}
          {{- end }}
          {{- if $s.probes.liveness.enabled }}
          livenessProbe:
            {{- include "sluice.probe" (list $s.probes.liveness $root.Values.health.livenessPath) | nindent 12 }}
          {{- end }}
          {{- if $s.probes.readiness.enabled }}
          readinessProbe:
            {{- include "sluice.probe" (list $s.probes.readiness $root.Values.health.readinessPath) | nindent 12 }}
          {{- end }}
          {{- with $root.Values.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          resources:
            {{- toYaml $s.resources | nindent 12 }}
          volumeMounts:
            {{- include "sluice.volumeMounts" $root | nindent 12 }}
      volumes:
        {{- include "sluice.volumes" (list $root (printf "%s-site" (include "sluice.fullname" $root))) | nindent 8 }}
{{- if and $s.podDisruptionBudget.enabled (ge (int $s.replicas) 2) }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  labels:
    {{- include "sluice.labels" $root | nindent 4 }}
    {{- toYaml $selector | nindent 4 }}
spec:
  {{- if hasKey $s.podDisruptionBudget "minAvailable" }}
  minAvailable: {{ $s.podDisruptionBudget.minAvailable }}
  {{- else }}
  maxUnavailable: {{ $s.podDisruptionBudget.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "sluice.selectorLabels" $root | nindent 6 }}
      {{- toYaml $selector | nindent 6 }}
{{- end }}
{{- end }}
