# The two set-up commands of a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench zoo fuzz mutate mutate-report venv clean

venv: $(STAMP)

$(STAMP): setup.py setup.cfg
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) -m moe_autograd demo

bench: $(STAMP)
	$(PY) -m moe_autograd bench

# The differential oracle on many more cases than `make test` runs, from a
# fresh seed (printed; replay: pytest tests/oracle --fuzz-seed=S --fuzz-case=K).
FUZZ_CASES ?= 20000
fuzz: $(STAMP)
	@seed=$${FUZZ_SEED:-$$(date +%s)}; echo "fuzz seed: $$seed ($(FUZZ_CASES) cases)"; \
	MOE_AUTOGRAD_FUZZ_CASES=$(FUZZ_CASES) $(PY) -m pytest tests/oracle -p no:cacheprovider \
		--fuzz-seed=$$seed

# Every case of the transformers zoo (tests/moe/test_zoo_*.py); make test runs a subset.
zoo: $(STAMP)
	MOE_AUTOGRAD_ZOO=all $(PY) -m pytest tests/moe/test_zoo_*.py

# Mutation testing (tools/mutate.py, mutmut): SHARD=all (default) runs every
# shard, smallest first; SHARD=remote-state etc. one alone (`python
# tools/mutate.py list`). Results stay in .mutate/<shard>/ (a rerun resumes);
# `make mutate-report` prints the kill rates and survivors.
SHARD ?= all
MUTATE_JOBS ?= 2
MUTATE_STAMP := $(VENV)/.mutate-installed

$(MUTATE_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,mutate]'
	touch $(MUTATE_STAMP)

mutate: $(MUTATE_STAMP)
	nice -n 10 $(PY) tools/mutate.py run $(SHARD) --jobs $(MUTATE_JOBS)

mutate-report: $(MUTATE_STAMP)
	$(PY) tools/mutate.py report

clean:
	rm -rf $(VENV) build *.egg-info .mutate mutants
