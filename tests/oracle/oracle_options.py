"""Reading the oracle's options: ``--fuzz-seed``, ``--fuzz-cases``,
``--fuzz-case`` (see ``conftest.py``), or their environment variables."""
import os
from typing import List, Optional

import pytest

DEFAULT_SEED = 0
# make test's sample (the sentinels' witness cases run besides): 600 keeps the
# suite within its 10 minutes on 2 cores (750 took it to 610 s on 2026-11-28);
# make fuzz runs 20000.
DEFAULT_CASES = 600


def _option(config: pytest.Config, name: str, env: str) -> Optional[str]:
    value = config.getoption(name, None)
    if value is None:
        value = os.environ.get(env)
    return None if value is None else str(value)


def fuzz_seed(config: pytest.Config) -> int:
    return int(_option(config, "--fuzz-seed", "MOE_AUTOGRAD_FUZZ_SEED") or DEFAULT_SEED)


def fuzz_cases(config: pytest.Config) -> int:
    return int(_option(config, "--fuzz-cases", "MOE_AUTOGRAD_FUZZ_CASES") or DEFAULT_CASES)


def fuzz_only(config: pytest.Config) -> Optional[List[int]]:
    value = _option(config, "--fuzz-case", "MOE_AUTOGRAD_FUZZ_CASE")
    return None if not value else [int(v) for v in value.split(",")]
