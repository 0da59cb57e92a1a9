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
{{- with .Values.region.memberHosts }}
{{- $rs := deepCopy (default dict (get $site "region_service")) }}
{{- $_ := set $rs "member_hosts" . }}
{{- $_ := set $site "region_service" $rs }}
{{- end }}
{{- /*
Helm's values are JSON underneath, so a map key is always a string: the
dsids of gateway_public_keys and gateway_public_keys_file would come out
quoted ("2":), which the site file's strict model refuses.  Keys that are
whole numbers are written bare.
*/}}
{{- regexReplaceAll "(?m)^(\\s*)\"([0-9]+)\":" (toYaml $site) "${1}${2}:" }}
{{- end }}

{{/*
What the chart refuses in a site file before anything is installed, each
with what to set instead (the pods' `sluice config check` would refuse the
same things only once they start, or, for the region service's tokens, the
service itself as it starts):

- settings the site model removed (gateway_signing_key, receiver.sender_keys);
- a secret given twice (token and token_env, ...), which the chart's default
  site makes easy: it gives region_service.token_env and member_token_env;
- a secret written in the site file while siteFileStorage is ConfigMap;
- a `*_env` naming a variable no secretEnv entry sets;
- a region service without token and member_token (it binds its pod IP,
  and refuses to start there without both) unless allow_unauthenticated.
*/}}
{{- define "sluice.checkSite" -}}
{{- $site := include "sluice.siteDict" . | fromJson }}
{{- range $name := list "gateway_signing_key" "gateway_signing_key_file" "gateway_signing_key_env" }}
{{- if hasKey $site $name }}
{{- fail (printf "site: %s was removed: gateway batches are signed with the site's Ed25519 key now; set gateway_private_key_env (the key `sluice keys generate --site %v` writes, from a Secret through secretEnv) and give the other sites' public keys in gateway_public_keys (dsid: key); helm/README.md, section \"Tokens and keys\"" $name (get $site "site")) }}
{{- end }}
{{- end }}
{{- $receiver := get $site "receiver" }}
{{- if kindIs "map" $receiver }}
{{- range $name := list "sender_keys" "sender_keys_file" "sender_keys_env" }}
{{- if hasKey $receiver $name }}
{{- fail (printf "site: receiver.%s was removed: the receiver verifies batches with the sending sites' Ed25519 public keys; give them in gateway_public_keys (dsid: key, at the top of the site file), and this site's own private key in gateway_private_key_env; helm/README.md, section \"Tokens and keys\"" $name) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* Every secret of the site file: (where, its section, its name). */}}
{{- $secrets := list }}
{{- $rs := default dict (get $site "region_service") }}
{{- $subs := default dict (get $site "subscriptions") }}
{{- $secrets = append $secrets (list "region_service.token" $rs "token") }}
{{- $secrets = append $secrets (list "region_service.member_token" $rs "member_token") }}
{{- $secrets = append $secrets (list "subscriptions.token" $subs "token") }}
{{- $secrets = append $secrets (list "gateway_private_key" $site "gateway_private_key") }}
{{- $kafka := default dict (get $site "kafka") }}
{{- $secrets = append $secrets (list "kafka.sasl_password" $kafka "sasl_password") }}
{{- $secrets = append $secrets (list "kafka.ssl_key_password" $kafka "ssl_key_password") }}
{{- range $i, $sender := (get $site "gateway_senders" | default list) }}
{{- $remote := default dict (get $sender "remote") }}
{{- $secrets = append $secrets (list (printf "gateway_senders[%d].remote.sasl_password" $i) $remote "sasl_password") }}
{{- $secrets = append $secrets (list (printf "gateway_senders[%d].remote.ssl_key_password" $i) $remote "ssl_key_password") }}
{{- end }}
{{- /* A Kafka listener's connection to another cluster takes the same passwords (read by the dispatcher, so
its *_env may come from the dispatcher's own extraEnv and is not looked for in secretEnv). */}}
{{- $listenerSecrets := list }}
{{- range $i, $queue := (get $site "async_event_queues" | default list) }}
{{- $settings := default dict (get (default dict (get $queue "listener")) "settings") }}
{{- range $name := list "sasl_password" "ssl_key_password" }}
{{- if and (hasKey $settings $name) (not (kindIs "invalid" (get $settings $name))) }}
{{- $listenerSecrets = append $listenerSecrets (printf "async_event_queues[%d].listener.settings.%s" $i $name) }}
{{- end }}
{{- end }}
{{- $url := get $settings "url" }}
{{- if and (kindIs "string" $url) (regexMatch "^[A-Za-z][A-Za-z0-9+.-]*://[^/@:]*:[^/@]+@" $url) (ne $.Values.siteFileStorage "Secret") }}
{{- fail (printf "siteFileStorage: async_event_queues[%d].listener.settings.url holds a password, which a ConfigMap would store in the clear: leave it out of the URL and give it to the dispatcher from a Secret (PGPASSWORD for PostgreSQL, in dispatchers.byId.%s.extraEnv with a secretKeyRef), or set siteFileStorage: Secret" $i (get $queue "id")) }}
{{- end }}
{{- end }}
{{- $envNames := list }}
{{- range .Values.secretEnv }}
{{- $envNames = append $envNames .name }}
{{- end }}
{{- $inline := list }}
{{- range $secrets }}
{{- $where := index . 0 }}
{{- $section := index . 1 }}
{{- $name := index . 2 }}
{{- $given := list }}
{{- range $form := list $name (printf "%s_file" $name) (printf "%s_env" $name) }}
{{- if and (hasKey $section $form) (not (kindIs "invalid" (get $section $form))) }}
{{- $given = append $given $form }}
{{- end }}
{{- end }}
{{- if gt (len $given) 1 }}
{{- $hint := "" }}
{{- if hasPrefix "region_service." $where }}
{{- $hint = printf " (the chart's default site gives %s_env, and a `site:` you give is merged over it: set the form you drop to null, e.g. --set site.%s_env=null)" $name $where }}
{{- end }}
{{- fail (printf "site: %s is given %d ways (%s): give one of %s, %s_file, %s_env%s" $where (len $given) (join ", " $given) $name $name $name $hint) }}
{{- end }}
{{- if has $name $given }}
{{- $inline = append $inline $where }}
{{- end }}
{{- $variable := get $section (printf "%s_env" $name) }}
{{- if and $variable (not (has $variable $envNames)) }}
{{- fail (printf "secretEnv: the site file's %s_env names the variable %s, which no secretEnv entry sets: add {name: %s, secret: <Secret>, key: <key>} to secretEnv (the services, the config-check step and the topics Job all read it when they load the site file)" $where $variable $variable) }}
{{- end }}
{{- end }}
{{- $inline = concat $inline $listenerSecrets }}
{{- if and $inline (ne .Values.siteFileStorage "Secret") }}
{{- $fixes := list }}
{{- range $inline }}
{{- $fixes = append $fixes (printf "%s_env" .) }}
{{- end }}
{{- fail (printf "siteFileStorage: the site file holds %s, which a ConfigMap would store in the clear: give each from a Secret with its *_env form and secretEnv (%s, with secretEnv: [{name: <variable>, secret: <Secret>, key: <key>}]), or set siteFileStorage: Secret" (join ", " $inline) (join ", " $fixes)) }}
{{- end }}
{{- if and .Values.region.enabled (ne (toString (get $rs "allow_unauthenticated")) "true") }}
{{- $missing := list }}
{{- range $name := list "token" "member_token" }}
{{- if not (or (get $rs $name) (get $rs (printf "%s_file" $name)) (get $rs (printf "%s_env" $name))) }}
{{- $missing = append $missing (printf "region_service.%s" $name) }}
{{- end }}
{{- end }}
{{- if $missing }}
{{- $what := printf "%s is" (first $missing) }}
{{- if gt (len $missing) 1 }}
{{- $what = printf "%s are" (join " and " $missing) }}
{{- end }}
{{- fail (printf "site: %s not set: the region service listens on its pod IP and refuses to start there without region_service.token and member_token (anyone reaching the port could read and write every region). Give them from a Secret: region_service.token_env: SLUICE_REGION_TOKEN and member_token_env: SLUICE_REGION_MEMBER_TOKEN, with both in secretEnv (helm/README.md, section \"Tokens and keys\"); or set region_service.allow_unauthenticated: true" $what) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The site file as a dict. */}}
{{- define "sluice.siteDict" -}}
{{- include "sluice.site" . | fromYaml | toJson }}
{{- end }}

{{/* The ports of a host:port[,host:port] bootstrap list, as a JSON list of numbers (none for ""). */}}
{{- define "sluice.bootstrapPorts" -}}
{{- $ports := list }}
{{- range (splitList "," (toString (default "" .))) }}
{{- $port := regexFind "[0-9]+$" (trim .) }}
{{- if $port }}
{{- $ports = append $ports (int $port) }}
{{- end }}
{{- end }}
{{- toJson ($ports | uniq) }}
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
The Secrets projected into kafka.secretMountPath of one workload's pods:
kafka.secrets, then the workload's own kafkaSecrets (its Kafka principal).
Kubernetes refuses a projected volume that names one path twice, and the
service refuses a site file naming a TLS/SASL file its pod lacks: both are
said here, naming the workload, before anything is installed.  Files of a
Secret given without `items` are not known to the chart and not checked.
Arguments: (list root kafkaSecrets who own [lenient]): who names the workload
and own the value its kafkaSecrets come from, in messages.  With lenient true
(`helm test`'s pods, which must not stop a release from rendering) a problem
gives the JSON `false` instead of failing.
*/}}
{{- define "sluice.kafkaSources" -}}
{{- $root := index . 0 }}
{{- $own := index . 1 | default list }}
{{- $who := index . 2 }}
{{- $ownName := index . 3 }}
{{- $lenient := and (gt (len .) 4) (index . 4) }}
{{- $problem := "" }}
{{- $sources := concat ($root.Values.kafka.secrets | default list) $own }}
{{- $paths := dict }}
{{- $complete := true }}
{{- range $sources }}
{{- if not .items }}
{{- $complete = false }}
{{- end }}
{{- $secret := .name }}
{{- range .items }}
{{- $path := .path | trimPrefix "./" }}
{{- if and (hasKey $paths $path) (not $problem) }}
{{- $problem = printf "%s: the Secrets %s and %s both project %s into %s (kafka.secrets and %s share that folder, and Kubernetes refuses a path twice): give the file once" $who (get $paths $path) $secret $path $root.Values.kafka.secretMountPath $ownName }}
{{- end }}
{{- $_ := set $paths $path $secret }}
{{- end }}
{{- end }}
{{- if and $sources $complete }}
{{- $site := include "sluice.siteDict" $root | fromJson }}
{{- $mount := printf "%s/" ($root.Values.kafka.secretMountPath | trimSuffix "/") }}
{{- $connections := list (list "kafka" (get $site "kafka")) }}
{{- range $i, $sender := (get $site "gateway_senders" | default list) }}
{{- $connections = append $connections (list (printf "gateway_senders[%d].remote" $i) (default dict (get $sender "remote"))) }}
{{- end }}
{{- range $connections }}
{{- $where := index . 0 }}
{{- $section := index . 1 }}
{{- range $key := list "ssl_ca_location" "ssl_certificate_location" "ssl_key_location" "sasl_password_file" "ssl_key_password_file" }}
{{- $file := get $section $key }}
{{- if and $file (kindIs "string" $file) (hasPrefix $mount $file) }}
{{- if and (not (hasKey $paths (trimPrefix $mount $file))) (not $problem) }}
{{- $problem = printf "%s: the site file's %s.%s is %s, but no Secret of kafka.secrets or %s projects %s there: add it to one of them" $who $where $key $file $ownName (trimPrefix $mount $file) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $problem $lenient }}
{{- toJson false }}
{{- else if $problem }}
{{- fail $problem }}
{{- else }}
{{- toJson $sources }}
{{- end }}
{{- end }}

{{/*
The volumes every Sluice pod has (arguments: root, the site file's
ConfigMap or Secret, the Secrets to project into kafka.secretMountPath as
"sluice.kafkaSources" gives them): the site file, the Kafka TLS/SASL
material (when there is any), a writable work folder and /tmp (the root
filesystem is read-only), and extraVolumes.
*/}}
{{- define "sluice.volumes" -}}
{{- $siteName := index . 1 }}
{{- $kafkaSources := index . 2 }}
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
{{- if $kafkaSources }}
- name: kafka-secrets
  projected:
    defaultMode: 0440
    sources:
    {{- range $kafkaSources }}
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

{{/* Arguments: (list root kafkaSources), as "sluice.volumes". */}}
{{- define "sluice.volumeMounts" -}}
{{- $kafkaSources := index . 1 }}
{{- with index . 0 }}
- name: site
  mountPath: {{ .Values.siteMountPath }}
  readOnly: true
{{- if $kafkaSources }}
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
  store      the region's local store (region.store), or an empty dict: a volume
             named store at its mountPath, a claim per instance or an emptyDir
*/}}
{{- define "sluice.workload" -}}
{{- $root := .root }}
{{- $s := .settings }}
{{- $site := include "sluice.siteDict" $root | fromJson }}
{{- $selector := dict "app.kubernetes.io/component" .component "sluice/workload" .name }}
{{- $valuesKey := get (dict "region" "region" "sender" "senders" "dispatcher" "dispatchers" "receiver" "receiver" "subscriptions" "subscriptions") .component }}
{{- $ownName := printf "%s.kafkaSecrets" $valuesKey }}
{{- if .queueId }}
{{- $ownName = printf "%s.kafkaSecrets (or %s.byId.%s.kafkaSecrets)" $valuesKey $valuesKey .queueId }}
{{- end }}
{{- $kafkaSources := include "sluice.kafkaSources" (list $root $s.kafkaSecrets (printf "%s (the %s workload)" .name .component) $ownName) | fromJsonArray }}
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
  # The changelogs are the truth: instances need no ordered start, and one
  # without a store (or with a store it cannot trust) loads its buckets from them.
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
        # What the metrics Service (monitoring.serviceMonitor) selects: the pods serving /metrics.
        sluice/metrics: "true"
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
            {{- include "sluice.volumeMounts" (list $root $kafkaSources) | nindent 12 }}
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
            {{- include "sluice.volumeMounts" (list $root $kafkaSources) | nindent 12 }}
            {{- with .store }}
            - name: store
              mountPath: {{ .mountPath }}
            {{- end }}
      volumes:
        {{- include "sluice.volumes" (list $root (printf "%s-site" (include "sluice.fullname" $root)) $kafkaSources) | nindent 8 }}
        {{- if and .store (eq (get (default dict .store) "volume") "emptyDir") }}
        - name: store
          emptyDir:
            sizeLimit: {{ .store.size }}
        {{- end }}
  {{- if and .store (eq (get (default dict .store) "volume") "persistentVolumeClaim") }}
  volumeClaimTemplates:
    - metadata:
        name: store
        labels:
          {{- include "sluice.labels" $root | nindent 10 }}
          {{- toYaml $selector | nindent 10 }}
      spec:
        accessModes: [ReadWriteOnce]
        {{- with .store.storageClassName }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ .store.size }}
  {{- end }}
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
