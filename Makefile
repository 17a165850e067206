# megatron-gspo: every target sets up .venv first (idempotent; fast when nothing changed).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test demo lint clean

install: $(STAMP)

$(STAMP): setup.py tools/install.sh
	bash tools/install.sh

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m megatron_gspo.cli.main demo

lint: $(STAMP)
	$(PY) -m pip install -q -e ".[lint]"
	$(PY) -m ruff check megatron_gspo tests tools
	$(PY) -m ruff format --check megatron_gspo tests tools

clean:
	rm -rf $(VENV) build *.egg-info
