# The two set-up commands of a fresh machine: `make test` and `make demo`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench zoo latest fuzz compat mutate mutate-report venv clean

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

# The torch-version matrix: the oracle sample and the core, checkpoint and MoE
# tests on the oldest and the newest torch that setup.cfg allows, each in a
# venv of its own (built once, about 1.5 GB each, under COMPAT_DIR; see
# tools/compat.sh). `make test` runs everything on the pinned torch (2.13.0).
COMPAT_VERSIONS ?= 2.11.0 2.15.0
COMPAT_DIR ?= $(HOME)/.cache/moe_autograd/compat
COMPAT_TESTS := tests/oracle tests/test_parallel.py tests/test_autograd.py \
	tests/test_executor.py tests/test_checkpoint.py tests/test_checkpoint_frames.py \
	tests/test_parallel_checkpoint.py tests/test_rng.py tests/test_kept.py tests/test_tls.py \
	tests/test_terms.py tests/test_regressions_oracle.py tests/test_regressions_order.py \
	tests/test_param_inputs.py tests/test_compile.py tests/moe/test_moe_layer.py \
	tests/moe/test_moe_faults.py tests/moe/test_moe_gaps.py tests/moe/test_moe_forced_inline.py \
	tests/moe/test_moe_cold_start.py tests/moe/test_moe_memory.py
compat:
	@for v in $(COMPAT_VERSIONS); do \
		dir=$(COMPAT_DIR)/torch-$$v; \
		tools/compat.sh ready $$dir || tools/compat.sh venv $$v $$dir || exit 1; \
	done; \
	for v in $(COMPAT_VERSIONS); do \
		tools/compat.sh test $(COMPAT_DIR)/torch-$$v $(COMPAT_TESTS) || exit 1; \
	done

# Every case of the transformers zoo (tests/moe/test_zoo_*.py); make test runs a subset.
zoo: $(STAMP)
	MOE_AUTOGRAD_ZOO=all $(PY) -m pytest tests/moe/test_zoo_*.py

# The zoo and the Ray tests on the newest releases of what the test extra
# bounds (transformers, accelerate, ray), in a venv of their own under
# LATEST_DIR: a report of each new family (supported, refused by name, not
# built, failing) and of every known case that fails (tools/latest.sh).
LATEST_DIR ?= $(HOME)/.cache/moe_autograd/latest
latest:
	tools/latest.sh $(LATEST_DIR)

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
