#!/usr/bin/env bash
# End-to-end on kind: the chart's operator turns a TPUTrainingJob into a JobSet whose pod runs the
# CPU build of the trainer on a worker dressed up as a v7x TPU host, and the job reaches Succeeded
# with its MFU and step time in status.
#
#   bash tests/kind/run.sh            # needs docker, kind, kubectl, curl; helm is installed if missing
#
# Environment: KIND_CLUSTER (name, default tpu-operator-e2e), JOBSET_VERSION (default v0.12.0, the pin of
# scripts/cluster-versions.env),
# KEEP_CLUSTER=1 (do not delete the cluster at the end), JOB_TIMEOUT (seconds, default 900).
set -euo pipefail
cd "$(dirname "$0")/../.."

cluster=${KIND_CLUSTER:-tpu-operator-e2e}
jobset_version=${JOBSET_VERSION:-v0.12.0}
job_timeout=${JOB_TIMEOUT:-900}
operator_image=ghcr.io/tpu-operator/operator:0.1.0
workload_image=ghcr.io/tpu-operator/workload:0.1.0-cpu
namespace=tpu-system
job=kind-smoke
helm=$(command -v helm || bash scripts/install-helm.sh)
kubeconfig=$(mktemp)
export KUBECONFIG=$kubeconfig
proxy_pid=""

log() { printf '\n=== %s\n' "$*" >&2; }

diagnostics() {
  log "diagnostics"
  kubectl get nodes -o wide --show-labels || true
  kubectl get tpujobs,jobsets,jobs,pods -A -o wide || true
  kubectl get tpujob "$job" -o yaml || true
  kubectl describe pods -l "training.tpu-operator.dev/job=$job" || true
  kubectl logs -l "training.tpu-operator.dev/job=$job" --tail=200 || true
  kubectl -n "$namespace" logs deploy/tpu-operator --tail=300 || true
  kubectl get events -A --sort-by=.lastTimestamp | tail -50 || true
}

finish() {
  local status=$?
  [ -n "$proxy_pid" ] && kill "$proxy_pid" 2>/dev/null || true
  if [ "$status" -ne 0 ]; then
    diagnostics
    echo "FAILED (exit $status)" >&2
  fi
  if [ "${KEEP_CLUSTER:-0}" != 1 ]; then
    kind delete cluster --name "$cluster" >/dev/null 2>&1 || true
    rm -f "$kubeconfig"
  fi
  exit "$status"
}
trap finish EXIT

log "kind cluster $cluster: a control plane, a plain worker (operator, JobSet) and a worker that becomes the TPU host"
kind create cluster --name "$cluster" --kubeconfig "$kubeconfig" --wait 180s --config - <<'KIND'
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
  - role: worker   # becomes the TPU host (tainted)
  - role: worker   # runs the operator and the JobSet controller
KIND

log "JobSet $jobset_version from its release manifest"
kubectl apply --server-side -f "https://github.com/kubernetes-sigs/jobset/releases/download/${jobset_version}/manifests.yaml"
kubectl -n jobset-system wait --for=condition=Available deployment --all --timeout=300s

log "fake v7x TPU host: labels, taint, google.com/tpu capacity"
node="${cluster}-worker"
kubectl label node "$node" --overwrite \
  cloud.google.com/gke-tpu-accelerator=tpu7x \
  cloud.google.com/gke-tpu-topology=2x2x1 \
  cloud.google.com/gke-nodepool=tpu7x-2x2x1   # the JobSet's exclusive-topology key
kubectl taint node "$node" google.com/tpu=present:NoSchedule --overwrite
# Extended resources are advertised through the node's status subresource (no device plugin here).
proxy_log=$(mktemp)
kubectl proxy --port=0 >"$proxy_log" 2>&1 &
proxy_pid=$!
for _ in $(seq 50); do grep -q "Starting to serve" "$proxy_log" && break; sleep 0.2; done
proxy_port=$(sed -n 's/.*127.0.0.1:\([0-9]*\).*/\1/p' "$proxy_log" | head -1)
[ -n "$proxy_port" ] || { cat "$proxy_log" >&2; exit 1; }
curl -sSf -X PATCH -H "Content-Type: application/json-patch+json" \
  --data '[{"op": "add", "path": "/status/capacity/google.com~1tpu", "value": "4"},
           {"op": "add", "path": "/status/allocatable/google.com~1tpu", "value": "4"}]' \
  "http://127.0.0.1:${proxy_port}/api/v1/nodes/${node}/status" >/dev/null
kill "$proxy_pid"; proxy_pid=""
for _ in $(seq 60); do
  [ "$(kubectl get node "$node" -o jsonpath='{.status.allocatable.google\.com/tpu}')" = 4 ] && break
  sleep 1
done
[ "$(kubectl get node "$node" -o jsonpath='{.status.allocatable.google\.com/tpu}')" = 4 ]

log "images: operator and the CPU build of the workload"
docker build -q -f docker/operator.Dockerfile -t "$operator_image" .
docker build -q -f docker/workload.Dockerfile --build-arg VARIANT=cpu -t "$workload_image" .
kind load docker-image --name "$cluster" "$operator_image" "$workload_image"

log "helm install"
"$helm" install tpu-operator charts/tpu-operator --namespace "$namespace" --create-namespace \
  --set fullnameOverride=tpu-operator \
  --set image.repository="${operator_image%:*}" --set image.tag="${operator_image##*:}" \
  --set image.pullPolicy=Never \
  --set operator.defaultImage="$workload_image" \
  --set operator.metricsInterval=2 \
  --set operator.logLevel=DEBUG \
  --wait --timeout 300s
kubectl -n "$namespace" rollout status deployment/tpu-operator --timeout=120s

log "TPUTrainingJob $job"
kubectl apply -f tests/kind/job.yaml
deadline=$((SECONDS + job_timeout))
phase=""
while [ "$SECONDS" -lt "$deadline" ]; do
  phase=$(kubectl get tpujob "$job" -o jsonpath='{.status.phase}')
  case "$phase" in Succeeded|Failed|Invalid) break ;; esac
  sleep 5
done
kubectl get tpujobs -o wide
[ "$phase" = Succeeded ] || { echo "job phase is '$phase', not Succeeded" >&2; exit 1; }
kubectl get jobset "$job" >/dev/null   # the operator made a JobSet for it
# The pre-flight ran first, as a batch Job of the CPU image (it carries libtpu): True when it compiled and fit.
echo "Planned=$(kubectl get tpujob "$job" -o jsonpath='{.status.conditions[?(@.type=="Planned")].status}')" \
  "plan=$(kubectl get tpujob "$job" -o jsonpath='{.status.plan}')"

mfu=$(kubectl get tpujob "$job" -o jsonpath='{.status.mfu}')
step_time=$(kubectl get tpujob "$job" -o jsonpath='{.status.stepTimeSeconds}')
python3 - "$mfu" "$step_time" <<'PY'
import sys
mfu, step_time = (float(x) if x else None for x in sys.argv[1:3])
assert mfu is not None and 0 < mfu <= 1, f"status.mfu is {sys.argv[1]!r}, not in (0, 1]"
assert step_time is not None and step_time > 0, f"status.stepTimeSeconds is {sys.argv[2]!r}, not > 0"
print(f"status.mfu={mfu} status.stepTimeSeconds={step_time}")
PY
echo "PASSED: $job Succeeded with mfu=$mfu stepTimeSeconds=$step_time"
