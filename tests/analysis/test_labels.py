"""The house rules particular to ``analysis/`` (issue 28): one home per metric label and per verdict
word, claims found like strategies. The rules of every folder (``__all__``, file and function
sizes, the one-way flow) are in ``tests/test_house.py``."""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

import analysis.reproduce.claims as registry
from analysis import metrics, words
from analysis.reproduce.claims.base import Claim

REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / "analysis"


def sources() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def modules() -> list[Path]:
    """Every module of ``analysis/`` (the notebooks are scripts, not modules)."""
    return [p for p in sources() if "notebooks" not in p.parts]


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


def test_every_module_with_a_claim_is_registered_in_order() -> None:
    found = {c.name for c in registry.discover()}
    assert [c.name for c in registry.CLAIMS] == [c.name for c in sorted(
        registry.CLAIMS, key=lambda c: (c.order, c.name))]
    assert found == {c.name for c in registry.CLAIMS} and len(found) == len(registry.CLAIMS)
    for claim in registry.CLAIMS:
        assert (REPO / "conf" / "experiment" / f"{claim.experiment}.yaml").is_file(), claim.name


def test_a_new_claim_is_one_module_and_no_other_edit(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "zz_new_claim.py").write_text(
        "from analysis.reproduce.claims.base import Claim\n"
        "CLAIM = Claim(name='zz_new_claim', title='t', source='s', claim='c', deviations=(),\n"
        "              evaluate=lambda runs: [], order=1000)\n", encoding="utf-8")
    monkeypatch.setattr(registry, "__path__", [*registry.__path__, str(tmp_path)])
    try:
        found = registry.discover()
    finally:
        sys.modules.pop(f"{registry.__name__}.zz_new_claim", None)
    assert [c.name for c in found] == [c.name for c in registry.CLAIMS] + ["zz_new_claim"]
    assert isinstance(found[-1], Claim)


NUMBERS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten "
                                       "eleven twelve".split())}


def test_the_readme_does_not_miscount_the_claims() -> None:
    """The README may say how many claims ``make reproduce`` re-tests only if it is right (it
    says "published loss-scaling claims" without a count, so a new claim needs no README edit)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    said = re.findall(r"re-tests (\w+) published", readme)
    assert "re-tests published loss-scaling claims" in readme or said
    for word in said:
        n = int(word) if word.isdigit() else NUMBERS.get(word.lower())
        assert n is None or n == len(registry.CLAIMS), f"README counts {word} claims, " \
            f"the registry has {len(registry.CLAIMS)}"
