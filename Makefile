# GradientMail: the usual entry points. The test suite itself is scripts/test.sh (.ci/run).
.DEFAULT_GOAL := help
SHELL := /bin/bash

PYTHON ?= .venv/bin/python
HELM ?= .venv/bin/helm
REGISTRY ?= ghcr.io/gradientmail
TAG ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}/\1/p' charts/gradientmail-operator/Chart.yaml)
OPERATOR_IMAGE ?= $(REGISTRY)/operator:$(TAG)
NODE_IMAGE ?= $(REGISTRY)/node:$(TAG)
# docker or podman, whichever is installed (`make images CONTAINER=podman` to choose).
CONTAINER ?= $(shell command -v docker 2>/dev/null || command -v podman 2>/dev/null)
KIND ?= kind
KIND_CLUSTER ?= gradientmail
NAMESPACE ?= gradientmail

.PHONY: help
help: ## List the targets
	@grep -E '^[a-z][a-z-]*:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

.PHONY: install
install: ## Create .venv with everything (scripts/install.sh)
	scripts/install.sh

.PHONY: test
test: ## ruff, mypy and every test (scripts/test.sh; what CI runs)
	scripts/test.sh

.PHONY: test-charts
test-charts: install ## The chart, manifests and install tests only
	$(PYTHON) -m pytest -q tests/charts

.PHONY: crd
crd: install ## Regenerate the chart's CRD from gradientmail/launch/runspec.py
	$(PYTHON) -m gradientmail_operator.crd > charts/gradientmail-operator/crds/gradientmailruns.yaml

.PHONY: manifests
manifests: install crd ## Regenerate manifests/ and the chart README's values table
	$(PYTHON) -m tests.charts.manifests
	$(PYTHON) -m tests.charts.docs

.PHONY: lint-chart
lint-chart: install ## helm lint the chart with each documented values file
	$(HELM) lint --strict charts/gradientmail-operator
	for f in charts/gradientmail-operator/ci/*-values.yaml; do \
	  $(HELM) lint --strict charts/gradientmail-operator -f $$f || exit 1; done

.PHONY: images
images: ## Build the operator and node images (docker or podman; not on the dev machines)
	@if [[ -z "$(CONTAINER)" ]]; then \
	  echo "make images: no container engine: install docker or podman, or set CONTAINER=..." >&2; \
	  exit 1; fi
	$(CONTAINER) build -f images/operator/Dockerfile -t $(OPERATOR_IMAGE) .
	$(CONTAINER) build -f images/node/Dockerfile -t $(NODE_IMAGE) .

.PHONY: kind-up
kind-up: ## Create the kind cluster and the development MinIO
	$(KIND) create cluster --name $(KIND_CLUSTER) --config manifests/kind/kind-config.yaml
	kubectl apply -f manifests/kind/minio.yaml
	kubectl -n $(NAMESPACE) rollout status deployment/minio --timeout=180s

.PHONY: kind-load
kind-load: images ## Build the images and load them into the kind cluster
	$(KIND) load docker-image --name $(KIND_CLUSTER) $(OPERATOR_IMAGE) $(NODE_IMAGE)

.PHONY: kind-install
kind-install: ## helm install the chart into the kind cluster, with the loaded images
	$(HELM) upgrade --install gradientmail-operator charts/gradientmail-operator \
	  --namespace $(NAMESPACE) --create-namespace \
	  --set image.repository=$(REGISTRY)/operator --set image.tag=$(TAG) \
	  --set nodePods.image.repository=$(REGISTRY)/node --set nodePods.image.tag=$(TAG) \
	  --set image.pullPolicy=Never --wait --timeout 5m

.PHONY: kind-example
kind-example: ## Apply the example Secret and run, and watch it
	kubectl apply -f manifests/examples/s3-credentials.yaml -f manifests/examples/gradientmailrun.yaml
	kubectl get gmr -w

.PHONY: kind-down
kind-down: ## Delete the kind cluster
	$(KIND) delete cluster --name $(KIND_CLUSTER)
