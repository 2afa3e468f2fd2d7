"""The README stays true: its tables are generated from the committed results files, and its
test command is the one CI runs."""
import re
from pathlib import Path

import pytest

from flashmoe_science.bench.report import update_readme

ROOT = Path(__file__).resolve().parents[1]


DOCUMENTS = ("README.md", "docs/benchmarks.md")


@pytest.mark.parametrize("document", DOCUMENTS)
def test_tables_match_results_files(document):
    changed = update_readme(ROOT / "benchmarks" / "results", ROOT / document, check=True)
    assert not changed, f"{document}'s tables differ from benchmarks/results: run `flashmoe-science report`"


def test_ci_runs_the_readme_test_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r'pip install -e "\.\[test\]" && (python -m pytest[^\n`]*)', readme)
    assert command, "the README's quick start must show the test command"
    assert command.group(1).replace("python ", "python3 ") in ci
    assert "`python -m pytest -q -m targets`" in readme and "python3 -m pytest -q -m targets" in ci


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_results_table_has_a_file(document):
    names = re.findall(r"<!-- results:([\w+-]+) -->", (ROOT / document).read_text())
    assert names
    for name in names:
        assert name == "headline" or (ROOT / "benchmarks" / "results" / f"{name}.json").exists(), name


def test_readme_links_resolve():
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", (ROOT / "README.md").read_text()):
        assert (ROOT / target).exists(), target
