# Quick start: `make demo` runs the whole magic-queue cycle on the embedded lab;
# `make test` runs the test suite. Both bootstrap .venv (and, as root, the Debian
# packages libvirt-python builds against) on first use.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lab bench clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	./scripts/bootstrap.sh $(VENV)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/testflinger-magic demo $(DEMO_ARGS)

# Most tests wait on real processes (supervisord, the lab's servers, MAAS delays) rather than
# compute, so more workers than cores (pytest-xdist) cut the wall time even on two cores: with
# 4 the two cores were 55% busy (1,621 tests: 5m13s); with 6, 3m52s.
PYTEST_WORKERS ?= 6
test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

lab: $(STAMP)
	$(BIN)/testflinger-magic lab up

bench: $(STAMP)
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) demo-summary.json .pytest_cache
