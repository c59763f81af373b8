#!/usr/bin/env bash
# Build the local test control plane from the Go module proxy into a cache keyed by version:
#   $PDSERVE_CACHE/k8s-<version>-kwok-<version>/{etcd,kube-apiserver,kube-controller-manager,
#   kube-scheduler,kubelet,kube-proxy,coredns,kwok,registry,promtool}
# `build.sh lws` builds only the LeaderWorkerSet manager and its CRD into the same directory
# (lws-manager, lws-crd.yaml; make lws-build), apart from the plane's build: off its critical path.
# A rerun with every binary present costs nothing. Prints the directory on stdout, progress on stderr.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! command -v go >/dev/null 2>&1; then
  echo "cluster build: Go >= 1.26 is required (https://go.dev/doc/install); none is on PATH" >&2
  exit 1
fi
# k8s.io/kubernetes asks for a Go we have; never let the go command fetch another toolchain.
export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0

k8s_version=$(cd "$here" && go list -m -f '{{.Version}}' k8s.io/kubernetes)
kwok_version=${PDSERVE_KWOK_VERSION:-v0.8.0}
cache=${PDSERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve}
out="$cache/k8s-$k8s_version-kwok-$kwok_version"
mkdir -p "$out"

major_minor=${k8s_version#v}
major=${major_minor%%.*}
minor=${major_minor#*.}; minor=${minor%%.*}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

# The LeaderWorkerSet controller manager (devtools/lws.py) from its own module (lws/go.mod), and
# the CRD its module ships, both keyed by the module's version and the module files' digest.
if [[ "${1:-}" == lws ]]; then
  lws_version=$(cd "$here/lws" && go list -m -f '{{.Version}}' sigs.k8s.io/lws)
  lws_version+="-$(cat "$here/lws/go.mod" "$here/lws/go.sum" "$here/lws/tools.go" | sha256sum | cut -c1-12)"
  if [[ -x "$out/lws-manager" && -f "$out/lws-crd.yaml" \
        && "$(cat "$out/lws-manager.version" 2>/dev/null)" == "$lws_version" ]]; then
    echo "cluster build: lws-manager $lws_version cached" >&2
  else
    echo "cluster build: compiling lws-manager $lws_version ..." >&2
    start=$SECONDS
    (cd "$here/lws" && go build -trimpath -ldflags "-s -w" -o "$out/lws-manager.tmp" sigs.k8s.io/lws/cmd)
    lws_dir=$(cd "$here/lws" && go list -m -f '{{.Dir}}' sigs.k8s.io/lws)
    cp "$lws_dir/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" "$out/lws-crd.yaml.tmp"
    chmod 644 "$out/lws-crd.yaml.tmp"  # the module cache is read-only
    mv "$out/lws-manager.tmp" "$out/lws-manager"
    mv "$out/lws-crd.yaml.tmp" "$out/lws-crd.yaml"
    echo "$lws_version" > "$out/lws-manager.version"
    echo "cluster build: lws-manager done in $((SECONDS - start))s" >&2
  fi
  echo "$out"
  exit 0
fi

build() {  # name package
  local name=$1 pkg=$2
  if [[ -x "$out/$name" ]]; then
    echo "cluster build: $name $k8s_version cached" >&2
    return
  fi
  echo "cluster build: compiling $name ($pkg) ..." >&2
  local start=$SECONDS
  (cd "$here" && go build -trimpath -ldflags "$ldflags" -o "$out/$name.tmp" "$pkg")
  mv "$out/$name.tmp" "$out/$name"
  echo "cluster build: $name done in $((SECONDS - start))s" >&2
}

build etcd ./etcd
build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver
build kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager
build kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler
# The real node (devtools/realnode.py): the same release's kubelet and kube-proxy.
build kubelet k8s.io/kubernetes/cmd/kubelet
build kube-proxy k8s.io/kubernetes/cmd/kube-proxy

# The real node's cluster DNS: CoreDNS with the kubernetes plugin only (coredns/main.go).
coredns_version=$(cd "$here/coredns" && go list -m -f '{{.Version}}' github.com/coredns/coredns)
coredns_version+="-$(cat "$here/coredns/main.go" "$here/coredns/go.sum" | sha256sum | cut -c1-12)"
if [[ ! -x "$out/coredns" || "$(cat "$out/coredns.version" 2>/dev/null)" != "$coredns_version" ]]; then
  echo "cluster build: compiling coredns $coredns_version ..." >&2
  start=$SECONDS
  (cd "$here/coredns" && go build -trimpath -ldflags "-s -w" -o "$out/coredns.tmp" .)
  mv "$out/coredns.tmp" "$out/coredns"
  echo "$coredns_version" > "$out/coredns.version"
  echo "cluster build: coredns done in $((SECONDS - start))s" >&2
else
  echo "cluster build: coredns $coredns_version cached" >&2
fi

go_install() {  # name module/package version [build tags]: `go install` of a released tool, cached
  local name=$1 pkg=$2 version=$3 tags=${4:-}
  local key="$version${tags:+ tags $tags}"
  if [[ -x "$out/$name" && "$(cat "$out/$name.version" 2>/dev/null)" == "$key" ]]; then
    echo "cluster build: $name $key cached" >&2
    return
  fi
  echo "cluster build: compiling $name $key ..." >&2
  local start=$SECONDS
  GOBIN="$out/.$name-bin" go install -trimpath -ldflags "-s -w" -tags "$tags" "$pkg@$version"
  mv "$out/.$name-bin/$name" "$out/$name"
  rmdir "$out/.$name-bin"
  echo "$key" > "$out/$name.version"
  echo "cluster build: $name done in $((SECONDS - start))s" >&2
}

go_install kwok sigs.k8s.io/kwok/cmd/kwok "$kwok_version"
# A real OCI registry (the CNCF distribution registry): the e2e tests push the images there as a
# user pushes them to their own, and the node pulls them (docs/operations.md, "Images").
go_install registry github.com/distribution/distribution/v3/cmd/registry \
  "${PDSERVE_REGISTRY_VERSION:-v3.0.0}"
# promtool (Prometheus v3; its Go module tags are v0.3xx): the chart's PrometheusRule is checked
# and its alerts evaluated against recorded series (tests/cluster/test_prometheus_rules.py).
# Without the service-discovery plugins (Prometheus's own remove_all_sd tag), which rule checks
# and rule tests never use: 3.6 instead of 8.3 CPU-minutes to compile cold on 2 cores.
go_install promtool github.com/prometheus/prometheus/cmd/promtool \
  "${PDSERVE_PROMTOOL_VERSION:-v0.316.0}" remove_all_sd
echo "$out"
