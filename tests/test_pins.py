"""The pins readers get from pip, conda and pyproject.toml agree."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins(text: str) -> dict[str, str]:
    found = re.findall(r"^[\s\-]*([A-Za-z0-9_.\-]+)==([^\s;#]+)", text, re.M)
    return {name.lower().replace("_", "-"): version for name, version in found}


def test_environment_yml_matches_constraints():
    constraints = _pins((ROOT / "constraints.txt").read_text())
    conda = _pins((ROOT / "environment.yml").read_text())
    assert len(conda) >= 10
    mismatched = {k: (v, constraints.get(k)) for k, v in conda.items() if constraints.get(k) != v}
    assert mismatched == {}, f"environment.yml disagrees with constraints.txt: {mismatched}"


def test_every_direct_dependency_is_pinned():
    constraints = _pins((ROOT / "constraints.txt").read_text())
    pyproject = (ROOT / "pyproject.toml").read_text()
    block = pyproject[pyproject.index("dependencies = [") : pyproject.index("[tool.setuptools")]
    direct = {
        name.lower().replace("_", "-")
        for name in re.findall(r'"([A-Za-z0-9_.\-]+)\s*(?:[<>=!~\[;]|")', block)
        if name != "pe-companion"
    }
    assert {"torch", "numpy", "triton", "jupyter-book", "nbval"} <= direct
    missing = sorted(direct - constraints.keys())
    assert missing == [], f"direct dependencies without an exact pin in constraints.txt: {missing}"
    assert constraints["torch"] == "2.13.0" and constraints["triton"] == "3.7.1"
