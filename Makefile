# All set-up happens here: a fresh machine needs only python3 and make.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: test lint typecheck unit interop-upstream fuzz robustness soak demo demo-control-plane bench bench-micro protos lock clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Reinstall only when the dependency list changes.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test: lint typecheck unit

# Upstream Rust ztunnel as a peer (tests/interop, docs/testing.md, "Interop with upstream ztunnel"): root, and
# ZTUNNEL_UPSTREAM_BIN=<upstream binary> built per ../shared/reference/upstream-build.md. A skip is a failure here.
interop-upstream: $(STAMP)
	@test -n "$(ZTUNNEL_UPSTREAM_BIN)" || { echo "interop-upstream: set ZTUNNEL_UPSTREAM_BIN to an upstream ztunnel binary (docs/testing.md)" >&2; exit 2; }
	ZTUNNEL_UPSTREAM_BIN="$(ZTUNNEL_UPSTREAM_BIN)" ZTUNNEL_UPSTREAM_TESTS=require ZTUNNEL_NETNS_TESTS=require \
		$(PY) -m pytest -q tests/interop tests/test_explain_upstream.py $(PYTEST_ARGS)

# The fuzz tests at 100x their bounded example counts, with random inputs (FUZZ_MAX_EXAMPLES=10000 is the scale:
# 100 = as in `make test`); prints how many examples each target ran.
FUZZ_MAX_EXAMPLES ?= 10000
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz FUZZ_MAX_EXAMPLES=$(FUZZ_MAX_EXAMPLES) $(PY) -m pytest -q --timeout 0 \
		--hypothesis-show-statistics $(PYTEST_ARGS) $$(find tests -name 'test_*_fuzz.py' | sort) tests/xds/test_wire.py

# Resource bounds at scale (docs/robustness.md): 10,000 idle SOCKS5 -> HBONE tunnels through two ztunnel processes
# (RSS and descriptors of each, KiB per tunnel), then 2,000 stalled TLS handshakes at 15008 (KiB each, all cut).
robustness: $(STAMP)
	$(PY) -m tests.robustness $(ROBUSTNESS_ARGS)

# 10 minutes of mixed traffic through two ztunnel processes; fails if RSS grows more than 10 % after the warm-up or
# the descriptors do not come back (tests/soak.py; SOAK_ARGS="--duration 60 --warmup 20" for a short run).
soak: $(STAMP)
	$(PY) -m tests.soak $(SOAK_ARGS)

demo: $(STAMP)
	$(PY) -m ztunnel.demo

# The same demo with config and certificates from the local control plane over gRPC (FAKE_CA=false, tokens).
demo-control-plane: $(STAMP)
	$(PY) -m ztunnel.demo --control-plane

bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)

# Micro-benchmarks of the hot functions (pytest-benchmark); not part of `make test`.
bench-micro: $(STAMP)
	$(PY) -m pytest bench/micro --benchmark-only -p no:cacheprovider $(PYTEST_ARGS)

protos: $(STAMP)
	$(PY) -m xds.generate

# Regenerate the image's pinned runtime dependencies after changing [project].dependencies.
lock: $(STAMP)
	$(PY) -m tests.packaging.lock > charts/image/requirements.lock

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
