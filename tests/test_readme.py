"""The README stays true: its tables are generated from the committed results files, and its
test command is the one CI runs."""
import re
from pathlib import Path

from flashmoe_science.bench.report import update_readme

ROOT = Path(__file__).resolve().parents[1]


def test_readme_tables_match_results_files():
    changed = update_readme(ROOT / "benchmarks" / "results", ROOT / "README.md", check=True)
    assert not changed, "README tables differ from benchmarks/results: run `flashmoe-science report`"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r'pip install -e "\.\[test\]" && (python -m pytest[^\n`]*)', readme)
    assert command, "the README's quick start must show the test command"
    assert command.group(1).replace("python ", "python3 ") in ci


def test_every_results_table_in_readme_has_a_file():
    names = re.findall(r"<!-- results:([\w+-]+) -->", (ROOT / "README.md").read_text())
    assert names
    for name in names:
        assert (ROOT / "benchmarks" / "results" / f"{name}.json").exists(), name
