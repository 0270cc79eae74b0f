# make demo / make test / make lint — each creates .venv and installs what it needs.
# Installing is skipped while pyproject.toml is unchanged (the stamp file below).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# Two tiers, both run by .ci/run. `make test`, the inner loop (under 8 minutes on 2 cores): every test except
# those marked slow (end-to-end runs, long engine and chaos runs, benchmark-shaped tests), soak, gpu or image.
# `make test-slow`: the tests marked slow. The long soak, GPU-only tests and the tests of the built image
# (`make image image-test`) have their own targets.
PYTEST_ARGS ?= -m "not slow and not soak and not gpu and not image"
SLOW_PYTEST_ARGS ?= -m "slow and not soak and not gpu and not image"

.PHONY: demo test test-slow lint soak fuzz gpu-test gpu-check clean image image-test

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch==2.13.0 is pinned in pyproject: pip takes the CPU wheel from the local wheel cache.
	$(BIN)/python -m pip install --quiet -e '.[serve,infra,dev]'
	@touch $@

test: $(STAMP)
	# pytest exits 5 when it collects no tests: make treats that as a failure, as it must.
	$(BIN)/pytest $(PYTEST_ARGS)

test-slow: $(STAMP)
	# exit 5 (no test selected, e.g. a misspelt marker) fails here too
	$(BIN)/pytest $(SLOW_PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check infra serving tests
	$(BIN)/mypy

# The CPU server image with podman (as root: installs podman, runc and mmdebstrap from Debian when
# missing; base image from the Debian mirror; layer cache in /var/tmp/specdeploy-podman). Prints the
# size and build time, fails over the size budget or when the scan finds secrets or unwanted files.
image: $(STAMP)
	$(BIN)/python -m infra.ops.image build
	$(BIN)/python -m infra.ops.image scan

# The built image run for real: starts, ready, non-root, healthcheck, read-only weights, drain on stop,
# and the quick launch profile against the container (~8-10 min here). They must run, not skip.
image-test: $(STAMP)
	SPECDEPLOY_REQUIRE_IMAGE=1 $(BIN)/pytest -m image

demo: $(STAMP)
	$(BIN)/python -m infra.ops.demo

soak: $(STAMP)
	SPECDEPLOY_SOAK_REPORT=$(CURDIR)/reports/soak-$$(date -u +%Y%m%dT%H%M%SZ) $(BIN)/pytest -m soak

# The API fuzz alone (also part of `make test-slow`): hypothesis against the served /openapi.json (~20 s).
fuzz: $(STAMP)
	$(BIN)/pytest -s tests/serving/chaos/test_fuzz.py

gpu-test: $(STAMP)
	$(BIN)/pytest -m gpu

# On a GPU host, in under 8 minutes (--budget-s): decode against the bandwidth bound on Llama-3-8B and ~1.1B shapes
# (random bf16 weights made on the card), batch 1 / 16 / 64, eager / captured / captured with the Triton kernels,
# verify(k+1) / decode(1): one table, and reports/gpu-check-*.json (infra/bench/gpu_check.py). Batch-1 int8 and
# fp8 runs: python -m infra.bench.bandwidth.
gpu-check: $(STAMP)
	$(BIN)/python -m infra.bench.gpu_check

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .specdeploy
