#!/usr/bin/env bash
# End to end on kind (needs a Docker engine and kind; the machines pdserve's CI runs on have
# neither, so CI exercises everything else: the chart on a real control plane, the simulator,
# the gateway). Builds both images, installs the chart, applies the simulator-backed example,
# waits for Ready and sends a chat completion through the gateway.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=$(.venv/bin/python -c 'import pdserve; print(pdserve.__version__)')
cluster=${PDSERVE_KIND_CLUSTER:-pdserve-e2e}
for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "e2e-kind needs $tool on PATH" >&2; exit 1; }
done

kind get clusters | grep -qx "$cluster" || kind create cluster --name "$cluster" --wait 120s
trap 'kill ${forward:-0} 2>/dev/null || true' EXIT
kind load docker-image --name "$cluster" "ghcr.io/pdserve/pdserve:$version" "ghcr.io/pdserve/pdserve-sim:$version"

helm upgrade --install pdserve charts/pdserve -n pdserve-system --create-namespace \
  --set image.pullPolicy=Never --wait --timeout 5m   # the CRD too (a template of the chart)
kubectl create namespace llm --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f examples/sim-qwen3.yaml
kubectl -n llm patch dm sim-qwen3 --type merge -p '{"spec":{"image":{"pullPolicy":"Never","gateway":"ghcr.io/pdserve/pdserve:'"$version"'"}}}'
kubectl -n llm wait --for=condition=Ready dm/sim-qwen3 --timeout=5m

kubectl -n llm port-forward svc/sim-qwen3-gateway 18000:8000 >/dev/null &
forward=$!
for _ in $(seq 1 50); do curl -fs localhost:18000/health >/dev/null && break; sleep 0.2; done
curl -fsS localhost:18000/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model":"sim-qwen3","messages":[{"role":"user","content":"What is the weather in Paris?"}],"max_tokens":64}'
echo
echo "e2e-kind: OK (delete the cluster with: kind delete cluster --name $cluster)"
