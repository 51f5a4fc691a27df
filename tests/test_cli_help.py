"""Every command line's ``--help`` gives each option a meaning and its default (issue 31).

The parsers are built by each module's ``main(argv)``; the test stops ``main`` at
``parse_args`` and reads the parser, so nothing runs."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from companion import longctx, pretrained
from companion.lab import __main__ as lab_main
from companion.lab import counting, grid_task
from companion.lab.extend import ExtendConfig
from companion.lab.sweep import EvalConfig
from companion.lab.train import TrainConfig


class _Stop(Exception):
    pass


def parser_of(main, monkeypatch) -> argparse.ArgumentParser:
    seen = []

    def stop(self, args=None, namespace=None):
        seen.append(self)
        raise _Stop

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(_Stop):
        main([])
    return seen[0]


def commands(parser: argparse.ArgumentParser):
    """``(name, parser)`` of the parser itself, or of each subcommand."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(parser.prog, parser)]
    return [(f"{parser.prog} {name}", p) for name, p in subs[0].choices.items()]


MAINS = {"lab": lab_main.main, "longctx": longctx.main, "counting": counting.main, "grid_task": grid_task.main,
         "pretrained": pretrained.main}


@pytest.mark.parametrize("name", MAINS)
def test_every_option_has_a_meaning_and_a_default(name, monkeypatch):
    parser = parser_of(MAINS[name], monkeypatch)
    checked = 0
    for prog, p in commands(parser):
        for action in p._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            flag = action.option_strings[-1]
            text = action.help or ""
            assert len(text.split()) >= 2, f"{prog} {flag}: no help text"
            assert "(required)" in text if action.required else "(default:" in text, \
                f"{prog} {flag}: the help does not say {'that it is required' if action.required else 'its default'}: {text!r}"
            checked += 1
    assert checked >= 5


def test_help_gives_the_dataclass_defaults(monkeypatch):
    """The config-field options show the dataclass's own default, so the help cannot drift."""
    parser = parser_of(lab_main.main, monkeypatch)
    sweep = dict(commands(parser))["python -m companion.lab sweep"]
    helps = {a.dest: a.help for a in sweep._actions}
    assert f"(default: {TrainConfig().steps})" in helps["steps"]
    assert "(default: 1 2 4 8 16)" in helps["multiples"]
    assert f"(default: {EvalConfig().windows})" in helps["windows"]


def test_every_config_field_has_a_meaning():
    names = {f.name for cls in (TrainConfig, EvalConfig, ExtendConfig) for f in fields(cls)}
    assert names <= set(lab_main.FIELD_HELP), sorted(names - set(lab_main.FIELD_HELP))
    assert set(lab_main.FIELD_HELP) <= names, sorted(set(lab_main.FIELD_HELP) - names)


def test_a_sweep_ends_with_its_results_table():
    from pathlib import Path

    import numpy as np

    from companion.utils import load_result

    data = load_result(Path(__file__).resolve().parents[1] / "chapters" / "data" / "08_sweep" / "rope-alibi.json")["data"]
    lines = lab_main.results_table(data).splitlines()
    assert lines[1].split()[:2] == ["scheme", "seeds"] and lines[1].split()[2:] == ["1x", "2x", "4x", "8x", "16x"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == {"rope", "alibi"}
    for scheme, line in rows.items():
        runs = [r for r in data["runs"] if r["config"]["scheme"] == scheme]
        tails = np.array([[r["eval"]["bpb"][str(w)]["tail"] for w in (128, 256, 512, 1024, 2048)] for r in runs])
        assert line.split()[1] == str(len(runs))
        assert [float(x) for x in line.split()[2::2]] == [round(float(v), 3) for v in tails.mean(0)]
