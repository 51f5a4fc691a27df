"""Tests for companion.lab.counting: the generator's labels, determinism, the splits (the
learning rate is chosen on a validation set that is not the test set), the trainer's plumbing
(a few steps, not the chapter's accuracies), the stored counts and bad arguments."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from companion.cope import CoPE
from companion.lab import counting
from companion.lab.counting import (
    EVAL_SEED,
    LONG_EVAL_SEED,
    SCHEMES,
    VALID_SEED,
    CountingBatch,
    CountingTask,
    TrainSettings,
    accuracy,
    best_lr,
    build_scheme,
    main,
    make_batch,
    marker_gates,
    run_all,
    summarize,
    evaluate_test_splits,
    train_and_eval,
)
from companion.lab.grid_task import unpack_hits
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
    for key in ("validation", "in_distribution", "longer_gaps"):
        acc = one[key]
        assert 0.0 <= acc["accuracy"] <= 1.0 and len(acc["by_k"]) == CountingTask().max_k
        assert acc["evaluated"] == TINY.eval_size
    assert one["long_task"]["gap_min"] == CountingTask().gap_max + 1
    assert one["settings"]["lr"] == TINY.lr
    # without test, the test splits are not scored at all
    val_only = train_and_eval("cope", 0, 3, settings=TINY, test=False)
    assert "in_distribution" not in val_only and "longer_gaps" not in val_only
    assert val_only["validation"] == one["validation"]


# ----------------------------------------------------------------------------- splits and counts


def test_the_validation_split_is_not_a_test_split():
    """Three fixed sets from three generators, none a training stream (the training batches
    come from the run's seed, a small int): no validation sequence is a test sequence (the
    sets are fixed, so this checks the seeds, not luck: two random sequences of 37 tokens
    coincide with probability about 16 ** -37)."""
    assert len({VALID_SEED, EVAL_SEED, LONG_EVAL_SEED}) == 3
    assert min(VALID_SEED, EVAL_SEED, LONG_EVAL_SEED) > max(counting.SEEDS)
    valid = make_batch(1000, VALID_SEED)
    test = make_batch(1000, EVAL_SEED)
    assert not {tuple(r) for r in valid.tokens.tolist()} & {tuple(r) for r in test.tokens.tolist()}


def test_train_and_eval_scores_the_validation_split_and_the_test_splits_it_names():
    res, model = train_and_eval("rope", 0, 3, settings=TINY, return_model=True)
    n, k = TINY.eval_size, CountingTask().max_k
    assert res["validation"] == accuracy(model, make_batch(n, VALID_SEED), k)
    assert res["in_distribution"] == accuracy(model, make_batch(n, EVAL_SEED), k)
    assert res["longer_gaps"] == accuracy(model, make_batch(n, LONG_EVAL_SEED, CountingTask().longer()), k)
    assert evaluate_test_splits(model, eval_size=n) == {key: res[key] for key in ("in_distribution", "longer_gaps")}


def test_accuracy_counts_and_flags_match_the_predictions():
    """The counts behind the accuracy and the per-sequence flags, against the model's own
    argmax read independently."""
    _, model = train_and_eval("nope", 0, 5, settings=TINY, return_model=True)
    batch = make_batch(203, 4)
    res = accuracy(model, batch, 4)
    with torch.no_grad():
        right = (model(batch.tokens)[:, -1].argmax(-1) == batch.answer).tolist()
    ks = batch.k.tolist()
    assert res["evaluated"] == 203 and res["correct"] == sum(right)
    assert res["accuracy"] == sum(right) / 203
    assert unpack_hits(res["hits"], 203).tolist() == right
    assert res["by_k_evaluated"] == [ks.count(j) for j in range(1, 5)]
    assert res["by_k_correct"] == [sum(r for r, kk in zip(right, ks) if kk == j) for j in range(1, 5)]
    assert res["by_k"] == [c / e for c, e in zip(res["by_k_correct"], res["by_k_evaluated"])]


def _run(scheme, lr, valid, acc_in=0.0, acc_long=0.0, seed=0):
    return {"scheme": scheme, "seed": seed, "settings": {"lr": lr}, "validation": {"accuracy": valid},
            "in_distribution": {"accuracy": acc_in}, "longer_gaps": {"accuracy": acc_long}}


def test_best_lr_is_the_argmax_of_the_mean_validation_accuracy():
    """The test accuracies point the other way in these runs: the choice must not see them."""
    runs = [_run("a", 0.01, 0.5, acc_in=1.0), _run("a", 0.01, 0.9, acc_in=1.0),   # mean 0.7
            _run("a", 0.003, 0.6, acc_in=0.0), _run("a", 0.003, 0.6, acc_in=0.0)]  # mean 0.6
    assert best_lr(runs) == 0.01
    runs = [_run("a", 0.01, 0.6, acc_in=1.0), _run("a", 0.003, 0.7, acc_in=0.0)]
    assert best_lr(runs) == 0.003
    assert best_lr([_run("b", 0.01, 0.5), _run("b", 0.003, 0.5)]) == 0.003  # a tie: the smaller rate
    with pytest.raises(ValueError, match="runs must hold at least one run"):
        best_lr([])
    with pytest.raises(ValueError, match=r"runs must be of one scheme, got \['a', 'b'\]"):
        best_lr([_run("a", 0.01, 0.5), _run("b", 0.01, 0.5)])


def test_run_all_scores_the_test_splits_at_the_chosen_rate_only():
    lrs = (3e-3, 3e-2)
    runs = run_all(["rope", "cope"], [0, 1], 4, lrs=lrs, settings=TINY)
    assert [(r["scheme"], r["settings"]["lr"], r["seed"]) for r in runs] == [
        (s, lr, seed) for s in ("rope", "cope") for lr in lrs for seed in (0, 1)]
    for name in ("rope", "cope"):
        mine = [r for r in runs if r["scheme"] == name]
        mean = {lr: sum(r["validation"]["accuracy"] for r in mine if r["settings"]["lr"] == lr) / 2 for lr in lrs}
        chosen = max(lrs, key=lambda lr: (mean[lr], -lr))
        for r in mine:
            tested = r["settings"]["lr"] == chosen
            assert ("in_distribution" in r) == ("longer_gaps" in r) == tested
            assert ("gates" in r) == (tested and name == "cope")
        s = summarize(runs)[name]
        assert s["best_lr"] == chosen and s["test"]["seeds"] == 2
        assert s["test"]["in_min"] == min(r["in_distribution"]["accuracy"] for r in mine if "in_distribution" in r)


def test_summarize_validation_by_rate_and_test_at_the_best():
    runs = [_run("a", 0.01, 0.5, 0.2, 0.1), _run("a", 0.01, 0.9, 0.4, 0.3, seed=1),
            _run("a", 0.003, 0.6), _run("a", 0.003, 0.6, seed=1),
            _run("b", 0.003, 1.0, 1.0, 1.0), _run("b", 0.01, 1.0, 0.0, 0.0)]
    del runs[2]["in_distribution"], runs[2]["longer_gaps"]  # an untested run at the other rate
    s = summarize(runs)
    assert list(s) == ["a", "b"]
    row = s["a"]["by_lr"]["0.01"]
    assert row["seeds"] == 2 and row["valid_min"] == 0.5 and math.isclose(row["valid_mean"], 0.7)
    assert s["a"]["by_lr"]["0.003"] == {"seeds": 2, "valid_mean": 0.6, "valid_min": 0.6}
    assert s["a"]["best_lr"] == 0.01
    test = s["a"]["test"]
    assert test["seeds"] == 2 and test["in_min"] == 0.2 and test["long_min"] == 0.1
    assert math.isclose(test["in_mean"], 0.3) and math.isclose(test["long_mean"], 0.2)
    assert s["b"]["best_lr"] == 0.003 and s["b"]["test"]["in_mean"] == 1.0  # a tie goes to the smaller rate


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


def test_command_line_writes_a_result(tmp_path):
    out = tmp_path / "counting.json"
    assert main(["--out", str(out), "--schemes", "nope", "--seeds", "0", "--lrs", "0.01", "--steps", "2",
                 "--long-steps", "3", "--long-schemes", "alibi"]) == 0
    payload = load_result(out)
    assert payload["provenance"]["command"].startswith("python -m companion.lab.counting --out")
    data = payload["data"]
    assert [r["scheme"] for r in data["runs"]] == ["nope"]
    assert data["summary"]["nope"]["best_lr"] == 0.01 and data["steps"] == 2
    assert data["splits"] == {"validation": VALID_SEED, "in_distribution": EVAL_SEED, "longer_gaps": LONG_EVAL_SEED}
    long = data["long"]
    assert long["steps"] == 3 and [(r["scheme"], r["steps"]) for r in long["runs"]] == [("alibi", 3)]
    assert long["summary"]["alibi"]["test"]["seeds"] == 1
    assert main(["--out", str(out), "--schemes", "nope", "--seeds", "0", "--lrs", "0.01", "--steps", "2",
                 "--long-steps", "0"]) == 0
    assert "long" not in load_result(out)["data"]


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
    ("--long-steps", ["-1"], "long_steps must be >= 0, got -1"),
    ("--long-schemes", ["cope", "cope"], "long_schemes must not repeat a value"),
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
    assert args == (["cope", "rope", "nope", "alibi"], [0, 1, 2, 3, 4], 800) and kwargs["lrs"] == [3e-3, 1e-2]


def test_command_line_runs_the_longer_budget_for_rope_and_cope_by_default(tmp_path, monkeypatch):
    """The default command runs both budgets: every scheme at STEPS, then RoPE and CoPE at
    LONG_STEPS (3x), with the same seeds and rates; --long-steps 0 skips the second."""
    calls = []

    def fake_run_all(*args, **kwargs):
        calls.append((args, kwargs))
        return []

    def stop(*args, **kwargs):
        raise _WorkStarted

    monkeypatch.setattr(counting, "run_all", fake_run_all)
    monkeypatch.setattr(counting, "save_result", stop)
    with pytest.raises(_WorkStarted):
        main(["--out", str(tmp_path / "c.json")])
    assert [c[0] for c in calls] == [(["cope", "rope", "nope", "alibi"], [0, 1, 2, 3, 4], counting.STEPS),
                                     (["cope", "rope"], [0, 1, 2, 3, 4], counting.LONG_STEPS)]
    assert counting.LONG_STEPS == 3 * counting.STEPS
    assert all(c[1]["lrs"] == list(counting.LRS) for c in calls)
    calls.clear()
    with pytest.raises(_WorkStarted):
        main(["--out", str(tmp_path / "c.json"), "--long-steps", "0"])
    assert len(calls) == 1
