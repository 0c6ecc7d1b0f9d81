{{/*
Names are cut to 63 characters (the DNS-1123 label limit) with a trailing "-" removed.
*/}}
{{- define "tpu-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tpu-operator.fullname" -}}
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

{{/* A name with a suffix, cut so that the whole stays within 63 characters. */}}
{{- define "tpu-operator.suffixed" -}}
{{- $suffix := index . 1 }}
{{- printf "%s-%s" (include "tpu-operator.fullname" (index . 0) | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix }}
{{- end }}

{{- define "tpu-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tpu-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tpu-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tpu-operator.labels" -}}
helm.sh/chart: {{ include "tpu-operator.chart" . }}
{{ include "tpu-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "tpu-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tpu-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tpu-operator.image" -}}
{{- $repository := required "image.repository is required: no operator image is published; build docker/operator.Dockerfile, push it to a registry the cluster pulls from and --set image.repository=REGISTRY/tpu-operator (docs/operations.md, Images)" .Values.image.repository }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The leader Lease's name (in the release namespace). */}}
{{- define "tpu-operator.leaseName" -}}
{{- include "tpu-operator.suffixed" (list . "leader") }}
{{- end }}

{{/*
The operator's command-line arguments (after the image's entrypoint `tpujob operator`).
--standalone: no kopf peering (it is not leader election: same-priority peers all pause); the replicas
elect a leader on a Lease instead (--leader-elect).
*/}}
{{- define "tpu-operator.args" -}}
- --standalone
{{- if .Values.leaderElection.enabled }}
- --leader-elect
- --leader-elect-resource-name={{ include "tpu-operator.leaseName" . }}
- --leader-elect-resource-namespace={{ .Release.Namespace }}
- --leader-elect-lease-duration={{ .Values.leaderElection.leaseDuration }}
- --leader-elect-renew-deadline={{ .Values.leaderElection.renewDeadline }}
- --leader-elect-retry-period={{ .Values.leaderElection.retryPeriod }}
{{- end }}
{{- if .Values.operator.watchNamespaces }}
{{- range .Values.operator.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
- --control-key-namespace={{ .Release.Namespace }}
- --health-port={{ .Values.operator.healthPort }}
- --metrics-port={{ .Values.operator.metricsPort }}
- --default-image={{ required "operator.defaultImage is required: no trainer image is published; build docker/workload.Dockerfile, push it to a registry the TPU nodes pull from and --set operator.defaultImage=REGISTRY/tpu-operator-workload:TAG (docs/operations.md, Images)" .Values.operator.defaultImage }}
- --metrics-access={{ .Values.operator.metricsAccess }}
- --metrics-interval={{ .Values.operator.metricsInterval }}
- --resync-interval={{ .Values.operator.resyncInterval }}
{{- with .Values.operator.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The operator's environment. */}}
{{- define "tpu-operator.env" -}}
- name: TPUJOB_LOG_LEVEL
  value: {{ .Values.operator.logLevel | quote }}
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_NAME  # the leader Lease's holderIdentity starts with it
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- with .Values.operator.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Everything that configures the running operator; its checksum is a pod annotation, so a change
to any of it rolls the pod (the operator reads its configuration only at start-up).
*/}}
{{- define "tpu-operator.config" -}}
image: {{ include "tpu-operator.image" . }}
args:
{{ include "tpu-operator.args" . }}
env:
{{ include "tpu-operator.env" . }}
{{- end }}

{{/*
RBAC rules on the namespaced resources the operator manages (used by the ClusterRole, or by one
Role per watched namespace). Exactly the verbs the operator uses; no wildcards.
*/}}
{{- define "tpu-operator.namespacedRules" -}}
- apiGroups: ["training.tpu-operator.dev"]
  resources: ["tputrainingjobs"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["training.tpu-operator.dev"]
  resources: ["tputrainingjobs/status"]
  verbs: ["patch"]
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "create", "deletecollection"]
{{- if eq .Values.operator.metricsAccess "proxy" }}
- apiGroups: [""]
  resources: ["pods/proxy"]
  verbs: ["get", "create"]
{{- end }}
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "watch", "patch"]
{{- end }}

{{/* Cluster-scoped reads: kopf scans CRDs; --all-namespaces also watches namespaces; TPU nodes' health. */}}
{{- define "tpu-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- /* Even with named namespaces kopf lists and watches namespaces (to learn that they exist); without the
permission a real API server answers 403 and kopf retries its namespace watch for as long as it runs. */}}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- /* TPU node health (operator/controller/health.py): GKE's partition-state label and Ready condition. */}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
{{- end }}

{{/* The leader election's Lease (operator/controller/leader.py): get (standbys poll it), create (the first
replica), update (acquire, renew, release). */}}
{{- define "tpu-operator.leaseRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "create", "update"]
{{- end }}

{{/* The control key's Secret (operator/controller/control.py), in the release namespace only: get, that Secret
alone (at start-up); create, the first start (RBAC cannot limit a create by name). */}}
{{- define "tpu-operator.controlKeyRules" -}}
- apiGroups: [""]
  resources: ["secrets"]
  resourceNames: ["tpu-operator-control-key"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
{{- end }}

{{/* Refuse value combinations the schema cannot express. */}}
{{- define "tpu-operator.validate" -}}
{{- if .Values.jobset.install }}
{{- fail "jobset.install=true is not supported: this chart does not bundle JobSet. Install it first from its release manifest, e.g. kubectl apply --server-side -f https://github.com/kubernetes-sigs/jobset/releases/download/v0.12.0/manifests.yaml, and keep jobset.install=false." }}
{{- end }}
{{- if and .Values.rbac.namespaced (not .Values.operator.watchNamespaces) }}
{{- fail "rbac.namespaced=true needs operator.watchNamespaces: a Role is created in each watched namespace, and watching all namespaces needs cluster-wide RBAC." }}
{{- end }}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) }}
{{- fail "replicaCount > 1 needs leaderElection.enabled=true: replicas without a leader would all reconcile every job." }}
{{- end }}
{{- if and .Values.leaderElection.enabled (not (lt (float64 .Values.leaderElection.renewDeadline) (float64 .Values.leaderElection.leaseDuration))) }}
{{- fail "leaderElection.renewDeadline must be below leaderElection.leaseDuration: a leader must have stopped before a standby can take the Lease." }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.service.enabled) }}
{{- fail "metrics.serviceMonitor.enabled=true needs metrics.service.enabled=true (a ServiceMonitor selects the Service)." }}
{{- end }}
{{- end }}
