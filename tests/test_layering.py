"""One room each: the modules of companion outside companion/lab/ never import companion.lab.

The methods (encodings, scaling, attention, kernels, the training-free methods) are what a
practitioner installs; the lab is the experiment engine built on them. An import from the
lab into a method module would tie every user of the method to the lab's corpus, trainer
and evaluation. The check reads the sources with ``ast`` (nothing is imported), resolves
relative imports against each module's package, and finds every form: ``import
companion.lab``, ``from companion import lab``, ``from .lab.x import y``, ``from ..lab import
y`` (in a subpackage), imports inside functions, and ``importlib.import_module`` or
``__import__`` of a constant name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "companion"
LAB = "companion.lab"

#: Modules outside companion/lab/ that may import the lab, and why. Keep it short: an entry
#: must still import the lab (test_every_exception_still_needs_the_lab).
EXPERIMENT_DRIVERS = {
    # chapter 10's experiment (the ``python -m companion.longctx`` command), not a method: it
    # reads the lab's corpus (token_stream) and chapter 9's scaling configs (method_config)
    "companion.longctx": "experiment driver",
    # chapter 10's second edition (issue 28): the document set reads the lab corpus's files and
    # split; the measures' intervals are the lab's bootstrap (companion.lab.stats)
    "companion.longctx_docs": "experiment driver",
    "companion.passkey": "experiment driver",
    # chapter 13's real-model temperature measurement (``python -m companion.longctx
    # temperature``): its YaRN conditions are chapter 9's configs (method_config), not a copy
    "companion.longctx_temperature": "experiment driver",
}


def module_name(path: Path) -> tuple[str, bool]:
    """The dotted name of the module at ``path`` and whether it is a package (``__init__``)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _is_lab(name: str) -> bool:
    return name == LAB or name.startswith(LAB + ".")


def _resolve(package: str, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` inside ``package``."""
    parts = package.split(".")
    base = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(base + ([name] if name else []))


def lab_imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, name)`` of every import of companion.lab (or a module inside it) in ``source``,
    the text of ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(package, node.level, node.module) if node.level else (node.module or "")
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            target = node.args[0].value
            if called in ("import_module", "__import__") and isinstance(target, str):
                dots = len(target) - len(target.lstrip("."))
                names = [_resolve(package, dots, target[dots:] or None) if dots else target]
        found += [(node.lineno, name) for name in names if _is_lab(name)]
    return sorted(set(found))


def _method_modules() -> list[Path]:
    lab = PACKAGE / "lab"
    return sorted(p for p in PACKAGE.rglob("*.py") if lab not in p.parents)


def test_the_package_has_modules_to_check():
    names = {module_name(p)[0] for p in _method_modules()}
    assert {"companion", "companion.trainfree", "companion.rope", "companion.kernels"} <= names
    assert not any(_is_lab(n) for n in names)


@pytest.mark.parametrize("path", _method_modules(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_method_module_imports_the_lab(path):
    module, is_package = module_name(path)
    if module in EXPERIMENT_DRIVERS:
        pytest.skip(f"{module}: {EXPERIMENT_DRIVERS[module]}")
    found = lab_imports(path.read_text(encoding="utf-8"), module, is_package)
    assert not found, f"{path.relative_to(PACKAGE.parent)} imports the lab: " + ", ".join(
        f"line {line}: {name}" for line, name in found)


def test_every_exception_still_needs_the_lab():
    for module in EXPERIMENT_DRIVERS:
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        assert path.is_file(), f"{module} is listed in EXPERIMENT_DRIVERS but does not exist"
        assert lab_imports(path.read_text(encoding="utf-8"), module), (
            f"{module} no longer imports the lab: remove it from EXPERIMENT_DRIVERS")


@pytest.mark.parametrize("source,module,is_package", [
    ("import companion.lab", "companion.rope", False),
    ("import companion.lab.evaluate as ev", "companion.rope", False),
    ("from companion.lab import evaluate", "companion.rope", False),
    ("from companion.lab.evaluate import LN2", "companion.rope", False),
    ("from companion import lab", "companion.rope", False),
    ("from companion import rope, lab as L", "companion.rope", False),
    ("from .lab import load_corpus", "companion.trainfree", False),
    ("from .lab.evaluate import LN2, window_bits", "companion.trainfree", False),
    ("from . import lab", "companion.trainfree", False),
    ("from .lab import x", "companion", True),  # the package's __init__
    ("from ..lab import x", "companion.kernels.rope", False),
    ("from .. import lab", "companion.kernels", True),
    ("def f():\n    from .lab.corpus import load_corpus\n    return load_corpus()", "companion.trainfree", False),
    ("import importlib\nm = importlib.import_module('companion.lab.corpus')", "companion.rope", False),
    ("from importlib import import_module\nm = import_module('.lab', 'companion')", "companion.rope", False),
    ("m = __import__('companion.lab')", "companion.rope", False),
])
def test_the_check_finds_every_form_of_a_lab_import(source, module, is_package):
    assert lab_imports(source, module, is_package), source


@pytest.mark.parametrize("source,module", [
    ("from .labels import x", "companion.trainfree"),
    ("import companion.labx", "companion.rope"),
    ("from companion import layout", "companion.rope"),
    ("from .rope import RotaryEmbedding\nimport torch", "companion.trainfree"),
    ("x = 'companion.lab'", "companion.rope"),
])
def test_the_check_passes_imports_of_other_modules(source, module):
    assert not lab_imports(source, module), source
