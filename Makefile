# kvgate — two commands: `make up` (local stack) and `make test` (the whole suite).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_MODEL := var/models/qwen2.5-demo

.PHONY: up test lint format install demo-model promtool clean protos postgres-server

# kvgate with its demo and dev extras, and the vLLM simulator (sim/, its own distribution).
$(STAMP): pyproject.toml sim/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[demo,dev]' -e ./sim
	# xds-protos ships older copies of opentelemetry-proto's modules (same paths): whichever
	# is installed last wins, so put the OpenTelemetry ones back (tracing needs them).
	$(BIN)/pip install --quiet --no-deps --force-reinstall \
		"opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	touch $(STAMP)

# The usage-record tests start their own PostgreSQL server (testbed/postgres_harness.py):
# its binaries come from Debian's postgresql package, installed here when missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
postgres-server:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || \
		{ $(SUDO) apt-get update -qq && \
		  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq postgresql; }

install: $(STAMP) postgres-server

$(DEMO_MODEL)/tokenizer.json: $(STAMP) tools/build_demo_tokenizer.py
	$(BIN)/python tools/build_demo_tokenizer.py $(DEMO_MODEL)

demo-model: $(DEMO_MODEL)/tokenizer.json

# promtool, for the alert rules' unit tests: taken out of Debian's prometheus package without
# installing it (no service, no root needed beyond apt's own download).
PROMTOOL := var/tools/promtool
$(PROMTOOL):
	rm -rf var/tools/prometheus-deb && mkdir -p var/tools/prometheus-deb
	cd var/tools/prometheus-deb && apt-get download prometheus
	dpkg -x var/tools/prometheus-deb/prometheus_*.deb var/tools/prometheus-deb/root
	cp var/tools/prometheus-deb/root/usr/bin/promtool $(PROMTOOL)
	rm -rf var/tools/prometheus-deb

promtool: $(PROMTOOL)

# Envoy :10000 -> kvgate :50051 (metrics :9464) -> vLLM simulator :8000, in the foreground.
up: install demo-model
	$(BIN)/python tools/up.py

test: install demo-model promtool
	$(BIN)/ruff check src sim testbed tests tools bench deploy
	$(BIN)/ruff format --check src sim testbed tests tools bench deploy
	$(BIN)/mypy
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check src sim testbed tests tools bench deploy
	$(BIN)/mypy

format: install
	$(BIN)/ruff format src sim testbed tests tools bench deploy
	$(BIN)/ruff check --fix src sim testbed tests tools bench deploy

clean:
	rm -rf $(VENV) var build *.egg-info

# Regenerate the admin API stubs after editing protos/ (the suite checks they are fresh).
protos: install
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=src --pyi_out=src \
		--grpc_python_out=src protos/kvgate/admin/v1/admin.proto
