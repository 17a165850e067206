# megatron-gspo: every target sets up .venv first (idempotent; fast when nothing changed).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The rollout environment: vLLM (CPU build without a GPU) + our vLLM plugin, apart from the trainer's .venv.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# The SGLang releases the engine is tested against, importable on a CPU (no GPU packages), for the conformance test.
SGLANG_CONFORMANCE := .venv-sglang-conformance
SGLANG_CONFORMANCE_STAMP := $(SGLANG_CONFORMANCE)/.installed

.PHONY: install rollout-env sglang-conformance-env slurm-env test demo lint clean bench-env bench-vs-trl

install: $(STAMP)

$(STAMP): setup.py tools/install.sh
	bash tools/install.sh

rollout-env: $(VLLM_STAMP)

$(VLLM_STAMP): setup.py tools/rollout_env.sh
	bash tools/rollout_env.sh

sglang-conformance-env: $(SGLANG_CONFORMANCE_STAMP)

$(SGLANG_CONFORMANCE_STAMP): $(STAMP) tools/sglang_conformance_env.sh megatron_gspo/rollout/sglang/versions.py
	bash tools/sglang_conformance_env.sh

# Debian's slurm-wlm + munge for the real-Slurm launch tests (tests/launch/test_slurm_jobs.py), installed when
# missing (as root; otherwise one line, and those tests skip). A system package, so no stamp: the script checks.
slurm-env:
	bash tools/slurm_env.sh

# The vLLM end-to-end tests (tests/rollout/vllm) start real servers from $(VLLM_VENV); the SGLang conformance test
# (tests/rollout/sglang/test_conformance.py) runs SGLang's own code from $(SGLANG_CONFORMANCE); the launch tests
# run the Slurm scripts under a real one-host Slurm (slurm-env).
# Two pytest workers (pytest-xdist), a test file each at a time (--dist loadfile: a module's server or Slurm
# cluster is started once, on one worker): most tests drive tiny models whose time goes to Python, not to torch's
# threads, so one test per core finishes the suite sooner than one test on both (README "Tests" has the figures).
# Then the tests marked `alone` (a weight update that must land while a real server is mid-generation), with
# nothing beside them. TEST_WORKERS=0 runs the first part in one process.
TEST_WORKERS ?= 2
test: $(STAMP) $(VLLM_STAMP) $(SGLANG_CONFORMANCE_STAMP) slurm-env
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone" tests
	$(PY) -m pytest -q -m alone tests

demo: $(STAMP)
	$(PY) -m megatron_gspo.cli.main demo --overwrite

# The TRL baseline of tools/bench_vs_trl.py lives in its own environment (.bench-env, ignored); not part of `test`.
bench-env: .bench-env/.installed

.bench-env/.installed: tools/bench_env.sh
	bash tools/bench_env.sh
	touch $@

bench-vs-trl: $(STAMP) bench-env
	$(PY) tools/bench_vs_trl.py

lint: $(STAMP)
	$(PY) -m pip install -q -e ".[lint]"
	$(PY) -m ruff check megatron_gspo tests tools
	$(PY) -m ruff format --check megatron_gspo tests tools

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_CONFORMANCE) build *.egg-info
