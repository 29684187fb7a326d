"""tools/zoo_report.py, the report of ``make latest``: a row per family or
experts class the zoo does not know, and every known case that failed."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="the zoo needs the examples extra")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite>
<testcase classname="tests.moe.test_zoo_models" name="test_model_equals_stock[mixtral-plain]"/>
<testcase classname="tests.moe.test_zoo_models" name="test_model_equals_stock[qwen9_moe-plain]"/>
<testcase classname="tests.moe.test_zoo_models" name="test_model_equals_stock[zeta_moe-plain]">
  <skipped message="new in transformers 9.0 (the zoo knows 5.25.0): zeta_moe: refused by name: NotImplementedError: ZetaExperts"/></testcase>
<testcase classname="tests.moe.test_zoo_models" name="test_model_equals_stock[eta_moe-plain]">
  <skipped message="new in transformers 9.0 (the zoo knows 5.25.0): eta_moe: the tiny builder cannot make it: ValueError: heads"/></testcase>
<testcase classname="tests.moe.test_zoo_experts" name="test_experts_class_equals_its_eager_loop[ThetaExperts-float32-k2]">
  <failure message="AssertionError: ThetaExperts float32 k=2: output differs"/></testcase>
<testcase classname="tests.moe.test_zoo_experts" name="test_experts_class_equals_its_eager_loop[MixtralExperts-bf16-k4]">
  <failure message="AssertionError: MixtralExperts bf16 k=4: output differs"/></testcase>
<testcase classname="tests.remote.test_ray_fleet" name="test_fleet"/>
</testsuite></testsuites>"""


def test_report_rows(tmp_path):
    path = tmp_path / "report.xml"
    path.write_text(REPORT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "zoo_report.py"), str(path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr  # a known case failed
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert "supported" in rows["qwen9_moe"]
    assert "refused by name" in rows["zeta_moe"] and "ZetaExperts" in rows["zeta_moe"]
    assert "not built" in rows["eta_moe"] and "heads" in rows["eta_moe"]
    assert "failing: AssertionError: ThetaExperts" in rows["ThetaExperts"]
    assert "mixtral" not in rows  # known and passing: no row
    assert "MixtralExperts bf16 k=4: output differs" in proc.stdout
    assert "ray tests: {'passed': 1}" in proc.stdout
