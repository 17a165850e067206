# megatron-gspo: every target sets up .venv first (idempotent; fast when nothing changed).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The rollout environment: vLLM (CPU build without a GPU) + our vLLM plugin, apart from the trainer's .venv.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install rollout-env test demo lint clean

install: $(STAMP)

$(STAMP): setup.py tools/install.sh
	bash tools/install.sh

rollout-env: $(VLLM_STAMP)

$(VLLM_STAMP): setup.py tools/rollout_env.sh
	bash tools/rollout_env.sh

# The vLLM end-to-end tests (tests/rollout/vllm) start real servers from $(VLLM_VENV).
test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m megatron_gspo.cli.main demo

lint: $(STAMP)
	$(PY) -m pip install -q -e ".[lint]"
	$(PY) -m ruff check megatron_gspo tests tools
	$(PY) -m ruff format --check megatron_gspo tests tools

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
