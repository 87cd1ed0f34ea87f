"""scripts/gpu_check.sh's conformance summary, run on reports as `specframe check` writes them: a GPU session is
rare and short, so its summary must not misread a passing report (a `--quick` run's totals line carries a note)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from specframe.testing.conformance import CheckResult, Report

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def summary_program() -> str:
    """The Python program gpu_check.sh feeds its summary step (the heredoc after `<< 'EOF'`)."""
    match = re.search(r"<< 'EOF'[^\n]*\n(.*?)\nEOF\n", SCRIPT.read_text(), re.S)
    assert match, "gpu_check.sh no longer has its summary heredoc"
    return match.group(1)


def check_line(name: str, passed: bool) -> CheckResult:
    return CheckResult(check=name, device="cuda", passed=passed, detail="...", dtype="bfloat16")


@pytest.mark.parametrize("quick", [False, True])
def test_summary_reads_passing_failing_and_cut_off_reports(tmp_path, quick):
    ok = Report("none", [check_line("greedy", True), check_line("rollback", True)], quick=quick)
    bad = Report("draft", [check_line("greedy", True), check_line("rollback", False)], quick=quick)
    reports = {"none-bfloat16": (ok.summary(), "0"), "draft-bfloat16": (bad.summary(), "1")}
    cut = "\n".join(ok.summary().splitlines()[:-1])  # (no totals line: stopped by its time limit)
    reports["eagle-bfloat16"] = (cut, "124")
    reports["medusa-bfloat16"] = ("\n".join(bad.summary().splitlines()[:-1]), "124")
    reports["union-bfloat16"] = (cut, "1")
    reports["ngram-bfloat16"] = (cut, "137")  # (killed after timeout's -k grace: cut off too)
    reports["repeat_last-bfloat16"] = ("", "124")  # (cut off before any check finished: nothing checked)
    for stem, (text, rc) in reports.items():
        (tmp_path / f"{stem}.txt").write_text(text + "\n")
        (tmp_path / f"{stem}.err").write_text("Traceback\n" if rc == "1" and stem == "union-bfloat16" else "")
        (tmp_path / f"{stem}.rc").write_text(rc + "\n")
    run = subprocess.run(
        [sys.executable, "-", str(tmp_path), "quick", "150"],
        input=summary_program(),
        capture_output=True,
        text=True,
        check=True,
    )
    lines = run.stdout.splitlines()
    assert "PASS conformance (quick) none-bfloat16: 2/2 checks passed" in lines, run.stdout
    assert "FAIL conformance (quick) draft-bfloat16: 1/2 checks passed" in lines, run.stdout
    # cut off with no check failed: CUT (said, not a failure); cut off after a failed check, or another exit: FAIL
    stopped = "then stopped (cut off by its 150 s time limit)"
    assert f"CUT conformance (quick) eagle-bfloat16: 2/2 checks passed, {stopped}" in lines, run.stdout
    assert f"FAIL conformance (quick) medusa-bfloat16: 1/2 checks passed, {stopped}" in lines, run.stdout
    assert "FAIL conformance (quick) union-bfloat16: 2/2 checks passed, then stopped (exit 1: Traceback)" in lines
    assert f"CUT conformance (quick) ngram-bfloat16: 2/2 checks passed, {stopped}" in lines, run.stdout
    assert f"FAIL conformance (quick) repeat_last-bfloat16: 0/0 checks passed, {stopped}" in lines, run.stdout


def test_summary_says_whether_the_checks_ran_through_cuda_graphs(tmp_path):
    graphed = CheckResult("greedy", "cuda", True, "3 prompts identical; verification forwards as CUDA graphs")
    off = CheckResult("greedy", "cuda", True, "3 prompts identical; CUDA graphs off: capturing failed: OOM")
    for stem, line in (("none-float32", graphed), ("eagle-float32", off), ("ngram-float32", check_line("greedy", 1))):
        (tmp_path / f"{stem}.txt").write_text(Report(stem, [line]).summary() + "\n")
        (tmp_path / f"{stem}.err").write_text("")
        (tmp_path / f"{stem}.rc").write_text("0\n")
    run = subprocess.run(
        [sys.executable, "-", str(tmp_path), "quick", "150"], input=summary_program(), capture_output=True, text=True
    )
    lines = run.stdout.splitlines()
    assert "PASS conformance (quick) none-float32: 1/1 checks passed (verification forwards as CUDA graphs)" in lines
    assert "PASS conformance (quick) eagle-float32: 1/1 checks passed (CUDA graphs off: capturing failed: OOM)" in lines
    assert "PASS conformance (quick) ngram-float32: 1/1 checks passed" in lines, run.stdout


@pytest.mark.parametrize(
    "line, complete",
    [
        ("SKIP benches: no Spec-Bench questions", False),
        ("CUT bench-graphs (cut off by its 300 s time limit): no report", False),
        ("PASS conformance (quick) none-bfloat16: 2/2 checks passed", True),
    ],
)
def test_the_last_line_says_whether_every_phase_ran(tmp_path, line, complete):
    # (a bench skipped for want of questions or of the model ended "every step passed")
    common = SCRIPT.with_name("gpu_common.sh")
    program = f'NAME=t OUT="{tmp_path}"; source "{common}"; say "{line}"'
    subprocess.run(["bash", "-c", program], capture_output=True, text=True, check=True)
    said = (tmp_path / "summary.txt").read_text().splitlines()
    incomplete = "no check failed, but not every phase ran to its end (SKIP or CUT above)"
    assert said[0] == line and said[-1].endswith("finished: " + ("every step passed" if complete else incomplete))
