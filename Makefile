# Better Compute — every target works from the root across all modules.
# `make help` lists them.

SHELL := /bin/bash
MODULES := proto pkg services agent tools deploy/kubernetes
GO ?= go
# go test flags: -count=1 by default, so a warm test cache never stands in for
# a run; a developer may set others (-run, -short).
TESTFLAGS ?= -count=1
BENCHFLAGS ?= -run '^$$' -bench . -benchmem -count 1

.DEFAULT_GOAL := help

.PHONY: help
help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: run
run: ## run the dev control plane: every role, embedded NATS, local or private PostgreSQL
	$(GO) run ./services/cmd/better-compute dev

.PHONY: build
build: ## build every binary into ./bin
	@mkdir -p bin
	cd services && $(GO) build -o ../bin/ ./cmd/...
	cd agent && $(GO) build -o ../bin/ ./cmd/...

.PHONY: test
test: ## run every module's tests with -race (real PostgreSQL and an embedded NATS server; installs chromium, qemu and podman when missing, TEST_DEPS=0 not)
	@tools/scripts/test-deps.sh
	@set -e; for m in $(MODULES); do \
		echo "== $$m"; (cd $$m && $(GO) test -race $(TESTFLAGS) ./...); \
	done

# The multi-process chaos suite (services/chaos): `make test` runs it with 4
# simulated nodes; this runs it with CHAOS_NODES nodes, CHAOS_COUNT times.
CHAOS_NODES ?= 50
CHAOS_COUNT ?= 3

.PHONY: chaos
chaos: ## the multi-process chaos suite with a larger fleet, repeated (CHAOS_NODES=50, CHAOS_COUNT=3)
	cd services && BC_CHAOS_NODES=$(CHAOS_NODES) $(GO) test -race -count=$(CHAOS_COUNT) -timeout 60m -run '^TestChaos$$' -v ./chaos/

# Fuzz targets, package:FuzzName (go test takes one -fuzz target per run).
FUZZ_TARGETS := \
	pkg/commands:FuzzKindEncode \
	pkg/webhooks:FuzzCheckEndpoint \
	pkg/providers:FuzzProviderResponse \
	pkg/nodeca:FuzzParseCSR \
	pkg/clientaddr:FuzzResolve \
	services/api:FuzzRequestBody \
	services/api:FuzzValidLabels \
	services/console:FuzzConsoleForms \
	services/joinservice:FuzzKeyOpen \
	services/joinservice:FuzzHardwareClaims \
	services/gateway:FuzzSessionRequest \
	agent/command:FuzzCommand \
	agent/site/pxe:FuzzProxyDHCP
FUZZTIME ?= 30s

.PHONY: fuzz
fuzz: ## run every fuzz target for FUZZTIME (30s) each; a crasher lands in the package's testdata/fuzz
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; name=$${t##*:}; echo "== $$pkg $$name"; \
		$(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) ./$$pkg; \
	done

.PHONY: fuzz-smoke
fuzz-smoke: ## run every fuzz target for 3s each (CI)
	@$(MAKE) --no-print-directory fuzz FUZZTIME=3s

.PHONY: screenshots
screenshots: ## drive the console in chromium against dev and write a PNG of each page to docs/console
	cd services && BC_SCREENSHOTS_DIR=$(CURDIR)/docs/console $(GO) test $(TESTFLAGS) -run '^TestScreenshots$$' -v ./console/

.PHONY: bench
bench: ## run every module's benchmarks; print one table of them beside this machine's limits (pgbench), written to .bench/results.md
	@mkdir -p .bench; : > .bench/raw.txt
	@set -e -o pipefail; for m in $(MODULES); do \
		echo "== $$m"; (cd $$m && $(GO) test $(BENCHFLAGS) ./... 2>&1 | tee -a $(CURDIR)/.bench/raw.txt); \
	done
	$(GO) run ./tools/cmd/benchtable --in .bench/raw.txt --out .bench/results.md

# What node telemetry costs a fleet (tools/scripts/telemetry-bench.sh):
# TELEMETRY_NODES simulated nodes in a bcsim process exporting OTLP every
# 10 s to one receiver process, measured over TELEMETRY_WINDOW seconds.
TELEMETRY_NODES ?= 1000
TELEMETRY_WINDOW ?= 60

.PHONY: bench-telemetry
bench-telemetry: ## telemetry export cost: TELEMETRY_NODES (1000) simulated nodes to one OTLP receiver, separate processes
	tools/scripts/telemetry-bench.sh $(TELEMETRY_NODES) $(TELEMETRY_WINDOW)

.PHONY: lint
lint: ## gofmt, go vet and golangci-lint (pinned in tools/) over every module
	tools/scripts/lint.sh

.PHONY: proto
proto: ## lint the .proto files and regenerate Go, gateway and OpenAPI code (offline)
	tools/scripts/proto.sh

.PHONY: proto-check
proto-check: ## fail when the committed generated code is stale
	tools/scripts/proto-check.sh

.PHONY: migrate
migrate: ## apply database migrations to database.url (DATABASE_URL)
	$(GO) run ./services/cmd/better-compute migrate up

.PHONY: tidy
tidy: ## go mod tidy in every module
	@set -e; for m in $(MODULES); do (cd $$m && $(GO) mod tidy); done

.PHONY: depaware
depaware: ## rewrite agent/cmd/bcd/depaware.txt, the packages bcd links (make test fails when it is stale)
	cd agent && $(GO) test -count=1 -run '^TestDepaware$$' ./cmd/bcd -update

.PHONY: modules-check
modules-check: ## fail unless every module builds alone (GOWORK=off) and its go.mod and go.sum are tidy
	tools/scripts/modules-check.sh

.PHONY: clean
clean: ## remove build output and the dev data directory
	rm -rf bin .data
