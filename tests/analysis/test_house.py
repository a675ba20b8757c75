"""The house rules of ``analysis/`` (issue 28): one home per metric label and per verdict word."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from analysis import metrics, words

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "analysis"


def sources() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant of ``path`` but its documentation (a string that
    is a statement of its own: module, class and function docstrings, attribute docstrings) and
    ``__all__``; an f-string's literal parts count (an implicit concatenation is one string)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and "__all__" in ast.unparse(node):
            skip |= {id(n) for n in ast.walk(node)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def written(paths: list[Path], phrases: set[str], flags: int = 0) -> list[str]:
    """``file:line: phrase`` for each phrase written (as a whole word) in a string of
    ``paths``."""
    found = []
    for path in paths:
        for line, text in strings(path):
            found += [f"{path.name}:{line}: {phrase!r}" for phrase in sorted(phrases)
                      if re.search(rf"(?<![\w-]){re.escape(phrase)}(?![\w])", text, flags)]
    return found


def outside(home: Path) -> list[Path]:
    return [p for p in sources() if p != home]


def test_a_metric_label_is_written_only_in_analysis_metrics() -> None:
    """Every table header, axis, caption and sentence that names a metric reads its label (or
    noun) from its :class:`analysis.metrics.Metric`; a capitalised one too (titles)."""
    phrases = {m.label for m in metrics.METRICS} | {m.noun for m in metrics.METRICS}
    bad = written(outside(ROOT / "metrics.py"), phrases, re.IGNORECASE)
    assert not bad, "metric labels written outside analysis/metrics.py (use its Metric):\n" + \
        "\n".join(bad)


def test_a_verdict_word_is_written_only_in_analysis_words() -> None:
    """The readings, the words across workloads and the claim verdicts, as written in tables
    and sentences (lower case; "Reproduced claims", a page's title, is no verdict)."""
    phrases = {*words.READINGS, *words.ACROSS, *words.VERDICTS, words.TOO_FEW}
    bad = written(outside(ROOT / "words.py"), phrases)
    assert not bad, "verdict words written outside analysis/words.py (import them):\n" + \
        "\n".join(bad)


def test_the_house_tests_see_a_label_or_word_written_twice(tmp_path: Path) -> None:
    twice = tmp_path / "twice.py"
    twice.write_text('"""The act-grad zero fraction and what is clearly better: documentation."""\n'
                     '__all__ = ["reproduced"]\n'
                     'COLS = ["Act-grad zero fraction [95% CI]", "no act-grad zero fractions"]\n'
                     'SAY = (f"{1} clearly "\n'
                     '       "better than native")\n', encoding="utf-8")
    labels = {m.label for m in metrics.METRICS}
    assert written([twice], labels, re.IGNORECASE) == ["twice.py:3: 'act-grad zero fraction'"]
    assert written([twice], {*words.READINGS, *words.VERDICTS}) == [
        "twice.py:4: 'clearly better'"]
