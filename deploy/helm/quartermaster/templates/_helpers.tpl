{{/* Names: "<release>" when the release name holds the chart's, else "<release>-quartermaster". */}}
{{- define "quartermaster.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "quartermaster.fullname" -}}
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

{{- define "quartermaster.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: quartermaster
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: include with (dict "root" $ "component" "web"). */}}
{{- define "quartermaster.selectorLabels" -}}
app.kubernetes.io/name: {{ include "quartermaster.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of a component's objects: the common ones, its name and component. */}}
{{- define "quartermaster.componentLabels" -}}
{{ include "quartermaster.labels" .root }}
app.kubernetes.io/name: {{ include "quartermaster.name" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "quartermaster.serviceAccountName" -}}
{{ include "quartermaster.fullname" .root }}-{{ .component }}
{{- end }}

{{- define "quartermaster.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Environment of every portal container: settings from the ConfigMap, secrets by reference. */}}
{{- define "quartermaster.envFrom" -}}
- configMapRef:
    name: {{ include "quartermaster.fullname" . }}
{{- end }}

{{- define "quartermaster.env" -}}
- name: SECRET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ required "secrets.secretKey.name: the Secret holding SECRET_KEY" .Values.secrets.secretKey.name }}
      key: {{ .Values.secrets.secretKey.key }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "secrets.databaseUrl.name: the Secret holding DATABASE_URL" .Values.secrets.databaseUrl.name }}
      key: {{ .Values.secrets.databaseUrl.key }}
- name: CELERY_BROKER_URL
  valueFrom:
    secretKeyRef:
      name: {{ required "secrets.brokerUrl.name: the Secret holding CELERY_BROKER_URL" .Values.secrets.brokerUrl.name }}
      key: {{ .Values.secrets.brokerUrl.key }}
{{- with .Values.portal.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The root filesystem is read-only: the var folder and /tmp are the only places a process writes. */}}
{{- define "quartermaster.volumeMounts" -}}
- name: var
  mountPath: /var/lib/quartermaster
- name: tmp
  mountPath: /tmp
{{- end }}

{{- define "quartermaster.volumes" -}}
- name: var
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end }}

{{/* The database check /healthz makes, for processes that serve no HTTP. */}}
{{- define "quartermaster.databaseProbe" -}}
exec:
  command:
    - python
    - -c
    - "import django, os; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'portal.settings'); django.setup(); from django.db import connection; connection.cursor().execute('SELECT 1')"
periodSeconds: 30
timeoutSeconds: 15
{{- end }}

{{/*
Rules of the runtime in the namespaces gangs run in, by component. The worker's
are exactly what preemption/runtimes/kubernetes/ calls; the web process only
reads logs (finding a gang's namespace through its record first).
*/}}
{{- define "quartermaster.workerJobRules" -}}
# launch: create; observe and the watch: list, watch; kill: delete;
# forget: patch (releases the exit-code finalizer). No get or update.
- apiGroups: [""]
  resources: [pods]
  verbs: [create, list, watch, delete, patch]
# signal: the policy/v1 Eviction subresource, one per rank.
- apiGroups: [""]
  resources: [pods/eviction]
  verbs: [create]
# The last megabytes of every rank's log, kept when its attempt ends.
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
# The gang record that owns everything else and keeps launch/signal times,
# and each gang's cadence hint (created at launch, patched while the gang runs,
# deleted with it). Ranks have no token: they read the hint through a volume.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [create, get, list, patch, delete]
# The rendezvous Service and the events-token Secret, removed by the garbage
# collector with the gang record: create is all the runtime needs.
- apiGroups: [""]
  resources: [services, secrets]
  verbs: [create]
# Each gang's NetworkPolicy (its ranks may reach each other), owned by the
# gang record like the Service.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create]
{{- end }}

{{- define "quartermaster.webJobRules" -}}
# read_log: find the gang's record, then stream one rank's log.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [list]
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
{{- end }}

{{/* A map as "key=value,key=value" (sorted), the format portal/env.py reads. */}}
{{- define "quartermaster.pairs" -}}
{{- $pairs := list }}
{{- range $key, $value := . }}
{{- $pairs = append $pairs (printf "%s=%v" $key $value) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/* team -> [prefix, ...] as "team=prefix|prefix,team2=prefix". */}}
{{- define "quartermaster.allowlist" -}}
{{- $pairs := list }}
{{- range $team, $prefixes := . }}
{{- $pairs = append $pairs (printf "%s=%s" $team (join "|" $prefixes)) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}
