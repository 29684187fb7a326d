"""moe_autograd.logs: the rate limit every reporter shares, the CLI's handler,
and the conventions (loggers under ``moe_autograd.*``, no handler installed
by the library)."""
import ast
import io
import logging
from pathlib import Path

import pytest

from moe_autograd.logs import RateLimit, configure_cli, held_back

ROOT = Path(__file__).resolve().parents[1] / "moe_autograd"


def test_rate_limit_lets_one_line_per_key_through_and_counts_the_rest() -> None:
    limit = RateLimit(every=10.0)
    assert limit.allow("a", now=100.0) == 0
    assert limit.allow("a", now=101.0) is None
    assert limit.allow("a", now=109.9) is None
    assert limit.allow("b", now=105.0) == 0  # keys are independent
    assert limit.allow("a", now=110.0) == 2  # the two held back since the last line
    assert limit.allow("a", now=111.0) is None
    assert held_back(2, 10.0) == " (2 more like it not logged in the last 10 s)"
    assert held_back(0, 10.0) == ""


def test_every_logger_is_named_by_its_module() -> None:
    """Every getLogger call in the package names the module (``__name__``),
    so that all of them sit under ``moe_autograd``; a module that also runs
    as a script (``if __name__ == "__main__"``) spells its name out, since
    ``python -m`` makes it ``__main__``."""
    offences = []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        script = 'if __name__ == "__main__"' in source
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("getLogger"):
                args = [ast.unparse(a) for a in node.args]
                named = bool(args) and args[0].strip("'\"").startswith("moe_autograd")
                if not (named or (args and args[0] == "__name__" and not script)):
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno}: {args}")
    assert offences == [], offences


@pytest.mark.timeout(60)
def test_the_library_installs_no_handler(run_python) -> None:
    out = run_python("""
        import logging
        import moe_autograd, moe_autograd.moe, moe_autograd.remote, moe_autograd.moe.stats
        names = [n for n in logging.root.manager.loggerDict if n.startswith("moe_autograd")]
        assert "moe_autograd.moe.stats" in names, names
        print(sum(len(logging.getLogger(n).handlers) for n in names + ["moe_autograd"]))
    """)
    assert out.strip() == "0"


def test_cli_handler_prints_prefixed_lines_once() -> None:
    stream = io.StringIO()
    root = logging.getLogger("moe_autograd")
    level = root.level
    try:
        configure_cli("moe_autograd test", stream=stream)
        configure_cli("moe_autograd test", stream=stream)  # replaces, never doubles
        logging.getLogger("moe_autograd.some.module").info("hello %s", "there")
    finally:
        for handler in list(root.handlers):
            if getattr(handler, "_moe_autograd_cli", False):
                root.removeHandler(handler)
        root.setLevel(level)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[moe_autograd test] ")
    assert lines[0].endswith(" INFO hello there")
