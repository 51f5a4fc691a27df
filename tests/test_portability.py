"""Portable outputs: the rules that let stored notebook outputs pass on any reader's CPU.

DESIGN.md section 4, "Portable outputs": rounding-level quantities print the bound they meet,
experiment results are glued at the precision the prose shows, and the few cells whose output
is not compared say why. Such a cell carries nbval's tag (``nbval-ignore-output``,
``nbval-skip`` or ``nbval-raises-exception``, out of the reader's sight) and states its reason
in its metadata, ``"nbval-reason"``; a page not yet moved to tags may still carry the old
comment marker, with the reason on the marker's own line. These tests read the committed notebooks
(no execution), so they are cheap; ``make test-portable`` is what re-runs them under other
numeric configurations.
"""

from __future__ import annotations

import importlib.util
import os
import re
from fractions import Fraction
from pathlib import Path

import nbformat
import pytest
import torch

from companion.utils import NUMERIC_ENV_VARS, numeric_config, provenance

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "book").glob("*.ipynb"))
GLUE_MIME = "application/papermill.record/text/plain"


def _load_marker_rule():
    """The rule nbval applies (chapters/conftest.py), imported so that there is only one."""
    spec = importlib.util.spec_from_file_location("chapters_conftest", ROOT / "chapters" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_marker


parse_marker = _load_marker_rule()


def code_cells(path: Path) -> list[tuple[int, str, list]]:
    nb = nbformat.read(path, as_version=4)
    return [(i, c.source, c.get("outputs", [])) for i, c in enumerate(nb.cells) if c.cell_type == "code"]


#: nbval's cell tags (nbval/plugin.py: its comment markers, lower case with dashes, and
#: ``raises-exception``) that turn a check off or change it.
NBVAL_TAGS = {"nbval-ignore-output", "nbval-check-output", "nbval-skip", "nbval-raises-exception",
              "raises-exception", "pytest-validate-ignore-output"}


def tagged_cells(path: Path) -> dict[int, tuple[set[str], dict]]:
    """Index -> (nbval tags, metadata) of every code cell that carries an nbval tag."""
    nb = nbformat.read(path, as_version=4)
    found = {}
    for i, c in enumerate(nb.cells):
        tags = set(c.get("metadata", {}).get("tags", [])) & NBVAL_TAGS
        if c.cell_type == "code" and tags:
            found[i] = (tags, c.metadata)
    return found


def marker_lines(source: str) -> list[str]:
    """Every comment line that mentions an nbval marker (well formed or not)."""
    return [line.strip() for line in source.splitlines() if line.strip().startswith("#") and "NBVAL_" in line]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 7


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_nbval_marker_gives_a_reason(path):
    """`# NBVAL_IGNORE_OUTPUT` alone is a quiet opt-out; it must say why, on the same line."""
    bare = []
    for index, source, _ in code_cells(path):
        for line in marker_lines(source):
            try:
                if parse_marker(line) is None:
                    bare.append((index, line))  # misspelt: nbval would ignore it silently
            except ValueError:
                bare.append((index, line))
    assert not bare, f"{path.name}: NBVAL markers without a reason (cell, line): {bare}"


def test_our_tags_are_the_ones_nbval_reads():
    import nbval.plugin as nbval_plugin

    assert NBVAL_TAGS == set(nbval_plugin.metadata_tags)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_nbval_tag_gives_its_reason(path):
    """A tag that turns a check off says why, in the cell's metadata: ``nbval-reason``, in at
    least two words (the tag itself is out of the reader's sight, and so is the reason)."""
    bare = [i for i, (_, meta) in tagged_cells(path).items()
            if len(str(meta.get("nbval-reason", "")).split()) < 2]
    assert not bare, f"{path.name}: cells {bare} carry an nbval tag without an 'nbval-reason'"


@pytest.mark.parametrize(
    "line, ok",
    [
        ("# NBVAL_IGNORE_OUTPUT: timing", False),  # one word is not a reason
        ("# NBVAL_IGNORE_OUTPUT: timing on a shared machine", True),
        ("# NBVAL_IGNORE_OUTPUT", False),
        ("# NBVAL_IGNORE_OUTPUT:", False),
        ("# NBVAL_IGNORE_OUTPUTS: timing of the kernel", False),
    ],
)
def test_the_reason_rule_itself(line, ok):
    try:
        parsed = parse_marker(line)
    except ValueError as exc:
        assert not ok and "must say why" in str(exc)
    else:
        assert (parsed is not None) is ok


def _short_binary(value: float) -> bool:
    """An exact result with a short binary expansion (ALiBi's slope 2^-8 = 0.00390625, a byte
    count over 2^20): every CPU computes it exactly, so its long decimal repr is safe."""
    numerator = Fraction(value).numerator
    while numerator and numerator % 2 == 0:
        numerator //= 2
    return abs(numerator).bit_length() <= 20


def _glued_floats(path: Path):
    not_compared = tagged_cells(path)
    for index, source, outputs in code_cells(path):
        if marker_lines(source) or index in not_compared:
            continue  # not compared by nbval
        for out in outputs:
            name = out.get("metadata", {}).get("scrapbook", {}).get("name")
            text = out.get("data", {}).get(GLUE_MIME)
            if name and text and re.fullmatch(r"-?\d+\.\d+(e[-+]?\d+)?", text):
                yield index, name, text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_glued_floats_are_rounded(path):
    """A glued float is stored as the repr of the value: a full-precision repr such as
    0.0549310147 holds digits that another CPU does not reproduce. Glue what the prose shows."""
    long = [
        (i, name, text) for i, name, text in _glued_floats(path)
        if len(re.sub(r"^-?0?\.?0*|e.*$|\.", "", text)) > 5 and not _short_binary(float(text))
    ]
    assert not long, f"{path.name}: glued floats with more than 5 significant digits: {long}"


def test_sanitizer_does_not_hide_floats():
    """The nbval sanitizer may normalise memory addresses, never digits of a number."""
    cfg = (ROOT / "tests" / "nbval_sanitize.cfg").read_text()
    regexes = [line.split(":", 1)[1].strip() for line in cfg.splitlines() if line.startswith("regex:")]
    assert regexes, "expected at least the memory-address rule"
    for regex in regexes:
        assert re.sub(regex, "X", "value 0.0549310147 and 1.23e-05") == "value 0.0549310147 and 1.23e-05", regex


def test_provenance_records_the_numeric_configuration():
    prov = provenance("pytest")
    cpu = prov["cpu_model"]
    assert cpu is None or (isinstance(cpu, str) and cpu.strip())
    if Path("/proc/cpuinfo").exists():
        assert cpu, "on Linux the CPU model comes from /proc/cpuinfo"
    assert prov["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert prov["blas"] in {"mkl", "open", "openblas", "accelerate", "blis", "generic", None}
    assert prov["torch_threads"] == torch.get_num_threads() >= 1
    assert set(prov["env"]) == {name for name in NUMERIC_ENV_VARS if name in os.environ}


def test_portability_settings_reach_torch():
    """Under the matrix's ATEN_CPU_CAPABILITY, torch really runs the requested kernels
    (a typo in the Makefile would otherwise test the default configuration twice)."""
    wanted = os.environ.get("ATEN_CPU_CAPABILITY")
    if wanted is None:
        pytest.skip("ATEN_CPU_CAPABILITY is not set: this is the default configuration")
    got = numeric_config()["torch_cpu_capability"]
    # torch never runs kernels wider than requested; it may run narrower ones on a CPU that
    # lacks the requested instructions.
    allowed = {"default": {"DEFAULT"}, "avx2": {"AVX2", "DEFAULT"}, "avx512": {"AVX512", "AVX2", "DEFAULT"}}
    if wanted.lower() not in allowed:
        pytest.skip(f"ATEN_CPU_CAPABILITY={wanted} is not one the matrix uses")
    assert got in allowed[wanted.lower()]


def test_config_independent_modules_exist_and_skip_only_under_the_matrix(monkeypatch):
    """The modules the portability re-runs leave out (tests/conftest.py) exist, and only their
    tests are deselected, and only when make test-portable says so."""
    from types import SimpleNamespace

    import conftest

    assert all((ROOT / "tests" / name).is_file() for name in conftest.CONFIG_INDEPENDENT)
    assert "test_portability.py" not in conftest.CONFIG_INDEPENDENT and "test_rope.py" not in conftest.CONFIG_INDEPENDENT

    def kept(flag: str | None) -> tuple[list[str], list[str]]:
        if flag is None:
            monkeypatch.delenv("COMPANION_PORTABILITY_RUN", raising=False)
        else:
            monkeypatch.setenv("COMPANION_PORTABILITY_RUN", flag)
        items = [SimpleNamespace(path=ROOT / "tests" / n) for n in ("test_pins.py", "test_rope.py", "test_prose.py")]
        dropped: list = []
        config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items)))
        conftest.pytest_collection_modifyitems(config, items)
        return [i.path.name for i in items], [i.path.name for i in dropped]

    everything = ["test_pins.py", "test_rope.py", "test_prose.py"]
    assert kept(None) == (everything, []) and kept("0") == (everything, [])
    assert kept("1") == (["test_rope.py"], ["test_pins.py", "test_prose.py"])


def test_make_runs_every_notebook_once_longest_first():
    """The nbval command lists every notebook exactly once, the longest (NB_LONGEST_FIRST) first."""
    import subprocess

    out = subprocess.run(["make", "-n", "--no-print-directory", "test-notebooks", "STAMP=Makefile"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(part for part in out.split("\n") if "--nbval" in part or ".ipynb" in part)
    listed = re.findall(r"\S+\.ipynb", out)
    assert sorted(listed) == sorted(str(p.relative_to(ROOT)) for p in NOTEBOOKS), line
    assert len(set(listed)) == len(listed)
    assert listed[0] == "chapters/10_pretrained_llm.ipynb" and "--no-loadscope-reorder" in out
