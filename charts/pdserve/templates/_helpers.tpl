{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: pdserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pdserve.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* "true" when the chart installs and upgrades the CRD (crds.install). Unset counts as true: an
upgrade with --reuse-values from a release whose chart had no crds value still gets the CRD. */}}
{{- define "pdserve.installCRDs" -}}
{{- $crds := .Values.crds | default dict -}}
{{- if or (not (hasKey $crds "install")) $crds.install -}}true{{- end -}}
{{- end -}}

{{- define "pdserve.webhookService" -}}
{{ include "pdserve.fullname" . }}-webhook
{{- end -}}

{{/* Rules the operator needs in every namespace it manages. Each says why. */}}
{{- define "pdserve.namespacedRules" -}}
# Read the models; write only their status (the spec belongs to the user and to Git).
- apiGroups: [pdserve.io]
  resources: [disaggregatedmodels]
  verbs: [get, list, watch]
- apiGroups: [pdserve.io]
  resources: [disaggregatedmodels/status]
  verbs: [get, patch]
# Children: server-side apply (create, patch), prune what a spec dropped (delete), observe.
- apiGroups: [apps]
  resources: [statefulsets, deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts]
  verbs: [get, list, watch, create, patch, delete]
# The gateways' peer key (a Secret per model with API keys, derived from the master key):
# applied each pass unread and pruned with the API keys. No get, list or watch: the operator
# never reads a user's Secret (its one read is the master's, in its own namespace: rbac.yaml).
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, watch, create, patch, delete]
# render.autoscaling.engine KEDA: the render pool's ScaledObject (applied, pruned when the
# engine changes; KEDA itself need not be installed for the others). The Builtin engine needs no
# /scale rights: the operator writes replicas in the workloads it applies anyway.
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# Engine pools whose replicas span nodes (nodesPerReplica > 1) are LeaderWorkerSets; the LWS
# controller itself need not be installed for the others.
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
# Each gateway gets its own Role and RoleBinding to discover its pods.
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
# Transport preflight: a probe Job per slice on its prefill and decode nodes.
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
# Status reads pods (placement, crash loops, the probes' reports); the gateway Role grants pods
# and endpointslices reads, and RBAC lets nobody grant what they do not hold. patch: the
# operator annotates engine pods with their slice's transport verdict (pdserve.io/kv-transport)
# for the gateway.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, patch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
{{- if .Values.networkPolicy.enabled }}
# networkPolicy.enabled: every model's NetworkPolicies (server-side apply, prune, and a watch so
# a policy deleted by hand is restored at once).
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
{{- else }}
# networkPolicy.enabled=false: none are made, but those made while it was true are pruned,
# which needs list (and watch: the operator's cache) and delete. (Without this rule they stay
# until their model is deleted.)
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch, delete]
{{- end }}
# Events on DisaggregatedModels (transitions, parity drift, invalid specs); list and watch: the
# gateways' replica-check Events on pods, read into ContractVerified as they come. (The gateway
# Role grants create.)
- apiGroups: [""]
  resources: [events]
  verbs: [create, get, patch, list, watch]
{{- end -}}
