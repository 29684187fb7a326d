"""Options of the differential oracle (``test_oracle.py``).

``--fuzz-seed=S`` (env ``MOE_AUTOGRAD_FUZZ_SEED``, default 0): the seed the
cases are drawn from; ``--fuzz-cases=N`` (env ``MOE_AUTOGRAD_FUZZ_CASES``,
default 1000): how many; ``--fuzz-case=K[,K...]`` (env
``MOE_AUTOGRAD_FUZZ_CASE``): only those cases (a failure prints the command).

pytest registers these options only when ``tests/oracle`` is named on the
command line (``pytest tests/oracle ...``); a plain ``pytest`` run reads the
environment variables instead.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from oracle_options import fuzz_cases, fuzz_only, fuzz_seed  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("oracle", "moe_autograd differential oracle")
    group.addoption("--fuzz-seed", type=int, default=None, help="seed of the oracle's cases")
    group.addoption("--fuzz-cases", type=int, default=None, help="number of oracle cases")
    group.addoption("--fuzz-case", default=None, help="only these case indices (K or K,K,...)")


def pytest_report_header(config: pytest.Config) -> str:
    only = fuzz_only(config)
    return (f"oracle: --fuzz-seed={fuzz_seed(config)} --fuzz-cases={fuzz_cases(config)}"
            + (f" --fuzz-case={','.join(map(str, only))}" if only else ""))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    module = sys.modules.get("test_oracle")
    lines = module.summary() if module is not None else []
    for line in lines:
        terminalreporter.write_line(line)
    if lines:
        config = terminalreporter.config
        terminalreporter.write_line(
            f"oracle: replay with pytest tests/oracle --fuzz-seed={fuzz_seed(config)} "
            f"--fuzz-cases={fuzz_cases(config)} [--fuzz-case=K]")
