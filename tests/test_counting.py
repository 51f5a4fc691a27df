"""Tests for companion.lab.counting: the generator's labels, determinism, the trainer's
plumbing (a few steps, not the chapter's accuracies) and bad arguments."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from companion.cope import CoPE
from companion.lab.counting import (
    CountingBatch,
    CountingTask,
    SCHEMES,
    TrainSettings,
    build_scheme,
    main,
    make_batch,
    marker_gates,
    summarize,
    train_and_eval,
)
from companion.utils import load_result

TASKS = {
    "default": CountingTask(),
    "longer": CountingTask().longer(),
    "fixed-gap": CountingTask(gap_min=3, gap_max=3),
    "adjacent-markers": CountingTask(gap_min=0, gap_max=0, extra_markers=0),
    "one-k": CountingTask(max_k=1, n_markers=2, n_noise=1, extra_markers=3),
}

TINY = TrainSettings(d_model=8, n_heads=2, n_layers=1, batch_size=4, eval_size=16, warmup=1)


def read_back(tokens: list[int], task: CountingTask):
    """Independent reading of one sequence: walk back from the query, collecting the markers
    and the noise runs between them. Returns (k, markers last-first, gaps last-first, lead)."""
    first_query = task.n_noise + task.n_markers
    assert first_query <= tokens[-1] < first_query + task.max_k
    k = tokens[-1] - first_query + 1
    markers, gaps, run = [], [], 0
    for tok in reversed(tokens[:-1]):
        assert 0 <= tok < first_query  # no query token inside the sequence
        if tok >= task.n_noise:
            markers.append(tok)
            gaps.append(run)
            run = 0
        else:
            run += 1
    return k, markers, gaps, run


@pytest.mark.parametrize("name", list(TASKS))
def test_labels_are_the_kth_last_marker(name):
    task = TASKS[name]
    batch = make_batch(300, 7, task)
    assert batch.tokens.shape == (300, task.seq_len) and batch.tokens.dtype == torch.int64
    ks = set()
    for row, answer, k_given in zip(batch.tokens.tolist(), batch.answer.tolist(), batch.k.tolist()):
        k, markers, gaps, _ = read_back(row, task)
        assert k == k_given
        assert answer == markers[k - 1]
        assert task.max_k <= len(markers) <= task.max_markers
        assert all(task.gap_min <= g <= task.gap_max for g in gaps)
        ks.add(k)
    assert ks == set(range(1, task.max_k + 1))  # every k is asked


def test_the_answer_distance_varies_and_longer_gaps_are_unseen():
    """The point of the task: the answer's token distance is not a function of k."""
    task = CountingTask()
    batch = make_batch(400, 3, task)
    dist = {}
    for row, k in zip(batch.tokens.tolist(), batch.k.tolist()):
        _, markers, gaps, _ = read_back(row, task)
        dist.setdefault(k, set()).add(sum(gaps[:k]) + k)
    for k, seen in dist.items():
        assert len(seen) > 3, (k, seen)
    long = task.longer()
    assert (long.gap_min, long.gap_max) == (task.gap_max + 1, 2 * task.gap_max + 1)
    assert long.seq_len > task.seq_len and long.vocab_size == task.vocab_size


def test_vocabulary_layout():
    task = CountingTask(n_noise=5, n_markers=3, max_k=2)
    assert task.vocab_size == 10
    assert task.query_token(1) == 8 and task.query_token(2) == 9
    assert task.is_marker(torch.arange(10)).tolist() == [False] * 5 + [True] * 3 + [False] * 2
    batch = make_batch(50, 0, task)
    assert int(batch.tokens.max()) < task.vocab_size


def test_determinism_under_a_seed():
    a, b = make_batch(64, 11), make_batch(64, 11)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = make_batch(64, 12)
    assert not torch.equal(a.tokens, c.tokens)
    g = torch.Generator().manual_seed(11)
    first, second = make_batch(64, g), make_batch(64, g)
    assert all(torch.equal(x, y) for x, y in zip(first, a))  # an int seed is a fresh generator
    assert not torch.equal(first.tokens, second.tokens)  # the generator advanced


def test_train_and_eval_is_deterministic_and_reports_every_field():
    one = train_and_eval("cope", 0, 3, settings=TINY)
    two = train_and_eval("cope", 0, 3, settings=TINY)
    one.pop("train_seconds"), two.pop("train_seconds")
    assert one == two
    other = train_and_eval("cope", 1, 3, settings=TINY)
    assert other["final_loss"] != one["final_loss"]
    for key in ("in_distribution", "longer_gaps"):
        acc = one[key]
        assert 0.0 <= acc["accuracy"] <= 1.0 and len(acc["by_k"]) == CountingTask().max_k
    assert one["long_task"]["gap_min"] == CountingTask().gap_max + 1
    assert one["settings"]["lr"] == TINY.lr


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_scheme_trains_a_step(name):
    res, model = train_and_eval(name, 0, 2, settings=TINY, return_model=True)
    assert math.isfinite(res["final_loss"])
    assert type(model.scheme) is type(build_scheme(name, 4, 2))


def test_cope_table_defaults_to_every_count():
    _, model = train_and_eval("cope", 0, 1, settings=TINY, return_model=True)
    assert model.scheme.npos == CountingTask().seq_len + 1
    _, model = train_and_eval("cope", 0, 1, settings=replace(TINY, npos=5), return_model=True)
    assert model.scheme.npos == 5


def test_marker_gates_reads_each_layer_and_restores_the_scheme():
    _, model = train_and_eval("cope", 0, 2, settings=replace(TINY, n_layers=2), return_model=True)
    batch = make_batch(8, 1)
    logits = model(batch.tokens)
    gates = marker_gates(model, batch)
    assert len(gates) == 2
    for g in gates:
        assert set(g) == {"marker", "noise", "query"}
        assert all(0.0 < v < 1.0 for v in g.values())
    assert "score" not in vars(model.scheme)  # the recording wrapper is gone
    assert torch.equal(model(batch.tokens), logits)


def test_summarize_means_minima_and_best_lr():
    def run(scheme, lr, acc_in, acc_long):
        return {"scheme": scheme, "settings": {"lr": lr}, "in_distribution": {"accuracy": acc_in},
                "longer_gaps": {"accuracy": acc_long}}

    runs = [run("a", 0.01, 0.5, 0.1), run("a", 0.01, 0.7, 0.3), run("a", 0.003, 0.6, 0.2),
            run("a", 0.003, 0.6, 0.4), run("b", 0.003, 1.0, 1.0), run("b", 0.01, 1.0, 0.0)]
    s = summarize(runs)
    row = s["a"]["by_lr"]["0.01"]
    assert row["seeds"] == 2 and row["in_min"] == 0.5 and row["long_min"] == 0.1
    assert math.isclose(row["in_mean"], 0.6) and math.isclose(row["long_mean"], 0.2)
    assert s["a"]["best_lr"] == 0.003  # a tie on the mean goes to the smaller rate
    assert s["b"]["best_lr"] == 0.003


def test_command_line_writes_a_result(tmp_path):
    out = tmp_path / "counting.json"
    assert main(["--out", str(out), "--schemes", "nope", "--seeds", "0", "--lrs", "0.01", "--steps", "2"]) == 0
    payload = load_result(out)
    assert payload["provenance"]["command"].startswith("python -m companion.lab.counting --out")
    data = payload["data"]
    assert [r["scheme"] for r in data["runs"]] == ["nope"]
    assert data["summary"]["nope"]["best_lr"] == 0.01


# ----------------------------------------------------------------------------- bad input


def test_bad_task_arguments():
    with pytest.raises(ValueError, match=r"gap_max \(2\) must be >= gap_min \(3\)"):
        CountingTask(gap_min=3, gap_max=2)
    with pytest.raises(ValueError, match="n_markers must be >= 2"):
        CountingTask(n_markers=1)
    with pytest.raises(ValueError, match="max_k must be >= 1"):
        CountingTask(max_k=0)
    with pytest.raises(ValueError, match="gap_min must be >= 0"):
        CountingTask(gap_min=-1)
    with pytest.raises(TypeError, match="extra_markers must be an int"):
        CountingTask(extra_markers=1.5)


def test_bad_batch_arguments():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        make_batch(0, 0)
    with pytest.raises(ValueError, match="generator must be >= 0"):
        make_batch(4, -1)
    with pytest.raises(TypeError, match="generator must be an int"):
        make_batch(4, "0")
    with pytest.raises(TypeError, match="task must be a CountingTask"):
        make_batch(4, 0, {"n_noise": 3})


def test_bad_training_arguments():
    with pytest.raises(ValueError, match="scheme_name must be one of"):
        train_and_eval("xpos", 0, 1, settings=TINY)
    with pytest.raises(ValueError, match="scheme_name must be one of"):
        build_scheme("xpos", 4, 2)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        train_and_eval("nope", 0, 0, settings=TINY)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        train_and_eval("nope", -1, 1, settings=TINY)
    with pytest.raises(TypeError, match="settings must be a TrainSettings"):
        train_and_eval("nope", 0, 1, settings={"lr": 1e-3})
    with pytest.raises(ValueError, match="long_task must share task's vocabulary"):
        train_and_eval("nope", 0, 1, settings=TINY, long_task=CountingTask(n_markers=3))
    with pytest.raises(ValueError, match=r"d_model \(10\) must be a multiple of n_heads \(4\)"):
        TrainSettings(d_model=10, n_heads=4)
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        TrainSettings(lr=0.0)
    with pytest.raises(ValueError, match="npos must be >= 1"):
        TrainSettings(npos=0)
    with pytest.raises(ValueError, match="grad_clip must be a finite number >= 0"):
        TrainSettings(grad_clip=-1.0)


def test_marker_gates_needs_a_cope_model():
    _, model = train_and_eval("rope", 0, 1, settings=TINY, return_model=True)
    with pytest.raises(TypeError, match="model must use a CoPE scheme, got RotaryEmbedding"):
        marker_gates(model, make_batch(4, 0))
    _, model = train_and_eval("cope", 0, 1, settings=TINY, return_model=True)
    assert isinstance(model.scheme, CoPE)
    with pytest.raises(TypeError, match="batch must be a CountingBatch"):
        marker_gates(model, make_batch(4, 0).tokens)
    assert isinstance(make_batch(1, 0), CountingBatch)


def test_build_scheme_names_a_wrong_type():
    """A list of names (or None) is a TypeError naming the argument, not "unhashable type"."""
    with pytest.raises(TypeError, match=r"scheme_name must be a str, one of \('cope'.*got list \['cope'\]"):
        build_scheme(["cope"], 8, 2)
    with pytest.raises(TypeError, match="scheme_name must be a str.*got NoneType"):
        build_scheme(None, 8, 2)
    assert isinstance(build_scheme("cope", 8, 2), CoPE)  # a name still builds


# ----------------------------------------------------------------------------- the command line


class _WorkStarted(Exception):
    pass


@pytest.fixture
def no_work(monkeypatch):
    """run_all and save_result replaced by guards: a bad flag must stop the command before them.
    Returns the list of the run_all calls the guard saw (args, kwargs)."""
    import companion.lab.counting as mod

    calls = []

    def guard(*args, **kwargs):
        calls.append((args, kwargs))
        raise _WorkStarted

    monkeypatch.setattr(mod, "run_all", guard)
    monkeypatch.setattr(mod, "save_result", guard)
    return calls


@pytest.mark.parametrize("flag, values, message", [
    ("--steps", ["0"], "steps must be >= 1, got 0"),
    ("--steps", ["-5"], "steps must be >= 1, got -5"),
    ("--threads", ["0"], "threads must be >= 1, got 0"),
    ("--seeds", ["-1"], "seeds must be >= 0, got -1"),
    ("--seeds", ["0", "0"], "seeds must not repeat a value"),
    ("--lrs", ["nan"], "lrs must be a finite number > 0, got nan"),
    ("--lrs", ["0"], "lrs must be a finite number > 0, got 0.0"),
    ("--lrs", ["-1e-3"], "lrs must be a finite number > 0"),
    ("--lrs", ["inf"], "lrs must be a finite number > 0, got inf"),
    ("--lrs", ["0.01", "0.01"], "lrs must not repeat a value"),
    ("--schemes", ["rope", "rope"], "schemes must not repeat a value"),
])
def test_command_line_checks_every_flag_before_work(tmp_path, capsys, no_work, flag, values, message):
    given = [f"{flag}={values[0]}"] if values[0].startswith("-") else [flag, *values]  # a negative number
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "c.json"), *given])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err
    assert no_work == []


def test_command_line_out_an_existing_folder(tmp_path, capsys, no_work):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), "--steps", "1"])
    assert exc.value.code == 2
    assert f"argument --out: out must be a file path, got the existing folder {str(tmp_path)!r}" in capsys.readouterr().err
    assert no_work == []


def test_command_line_valid_flags_reach_run_all_unchanged(tmp_path, no_work):
    """Valid flags pass the checks and reach run_all as parsed (defaults untouched)."""
    with pytest.raises(_WorkStarted):
        main(["--out", str(tmp_path / "c.json"), "--steps", "3", "--seeds", "2", "0", "--lrs", "0.01", "0.003",
              "--schemes", "rope", "cope", "--threads", "1"])
    (args, kwargs), = no_work
    assert args == (["rope", "cope"], [2, 0], 3) and kwargs["lrs"] == [0.01, 0.003]
    no_work.clear()
    with pytest.raises(_WorkStarted):
        main(["--out", str(tmp_path / "c.json")])
    (args, kwargs), = no_work
    assert args == (["cope", "rope", "nope", "alibi"], [0, 1], 800) and kwargs["lrs"] == [3e-3, 1e-2]
