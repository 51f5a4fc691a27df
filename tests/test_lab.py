"""Tests for the experiment engine :mod:`companion.lab`.

Corpus, batches, schemes by name or import path, the learning-rate schedule and the trainer
(checkpoints, resume), the evaluations (checked on hand-built models whose exact answer is
known), and the command line, including "bring your own scheme" with a scheme from
``tests/lab_user_scheme.py``. The two-process DDP test is in ``tests/test_lab_ddp.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import lab_user_scheme
from companion.alibi import ALiBi
from companion.attention import PositionScheme
from companion.lab import (
    BUILTIN,
    EvalConfig,
    TrainConfig,
    attention_entropy,
    bits_per_byte,
    build_scheme,
    evaluate_model,
    load_checkpoint,
    load_corpus,
    lr_at,
    passkey_retrieval,
    scheme_label,
    sliding_bits_per_byte,
    train,
)
from companion.lab.corpus import EXCLUDED_DIRS, split_of, stdlib_files
from companion.lab.data import KEY_CLOSE, KEY_DIGITS, KEY_LEN, KEY_OPEN, QUERY_LEN, sample_batch, windows
from companion.lab.evaluate import evenly_spaced_starts, shared_ends
from companion.lab.schemes import LABELS
from companion.model import TinyDecoder
from companion.utils import load_result

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
USER_SCHEME = "lab_user_scheme:LongBaseRotary"
DIGITS = set(range(ord("0"), ord("9") + 1))

#: The tiny model every training test uses (about 5k parameters, ~0.1 s for 30 steps).
TINY = dict(d_model=16, n_heads=2, n_layers=1, seq_len=32, batch_size=4, max_len=64)


@pytest.fixture(scope="module")
def stdlib():
    return load_corpus()


# ---------------------------------------------------------------------------------------
# corpus


INCLUDED = (
    ["top.py", "pkg/__init__.py", "pkg/core.py", "pkg/sub/deep.py", "pkg/test_names.py",
     "testing/helper.py", "tests_extra/x.py", "mytest/y.py"]
    + [f"a/m{i:02d}.py" for i in range(16)]
    + [f"b/c/n{i:02d}.py" for i in range(16)]
)
EXCLUDED = ["test/t1.py", "pkg/tests/t2.py", "a/b/test/deep/t3.py", "site-packages/lib/s.py",
            "pkg/site-packages/s2.py", "pkg/__pycache__/core.cpython-311.py"]
NOT_PY = ["README.txt", "pkg/core.pyc", "stubs.pyi", "notes.py.txt", "Makefile", "a/py"]


def _marker(rel: str) -> bytes:
    return f"# file <{rel}>\n".encode()


def _make_tree(root: Path, rels: list[str] = INCLUDED + EXCLUDED + NOT_PY) -> dict[str, bytes]:
    """Write fake source files under ``root``; return the contents of every file written."""
    rng = np.random.default_rng(0)
    contents = {}
    for rel in rels:
        body = bytes(rng.integers(32, 127, size=int(rng.integers(10, 300)), dtype=np.uint8))
        contents[rel] = _marker(rel) + body
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(contents[rel])
    return contents


def _splits(corpus) -> dict[str, set[str]]:
    """Which fake files each split holds, found by their markers."""
    text = {k: bytes(getattr(corpus, k)) for k in ("train", "val")}
    return {k: {rel for rel in INCLUDED + EXCLUDED + NOT_PY if _marker(rel) in t} for k, t in text.items()}


def test_corpus_file_selection(tmp_path):
    _make_tree(tmp_path)
    found = [p.as_posix() for p in stdlib_files(tmp_path)]
    assert found == sorted(INCLUDED)  # sorted, relative, excluded dirs pruned at any depth


def test_corpus_split_and_info(tmp_path):
    contents = _make_tree(tmp_path)
    corpus = load_corpus(tmp_path, val_fraction=0.3)
    splits = _splits(corpus)
    assert splits["train"] and splits["val"]
    assert not splits["train"] & splits["val"]  # never in both
    assert splits["train"] | splits["val"] == set(INCLUDED)  # every included file, nothing else
    for name in ("train", "val"):
        # the documented layout: sorted by path, one newline between files
        files = sorted(splits[name])
        expected = b"\n".join(contents[r] for r in files)
        assert bytes(getattr(corpus, name)) == expected
        assert getattr(corpus, name).dtype == np.uint8
        assert corpus.info["files"][name] == len(files)
        assert corpus.info["bytes"][name] == sum(len(contents[r]) for r in files) + len(files) - 1
    # the rule is the documented one: sha256 of the POSIX relative path
    for rel in INCLUDED:
        u = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") / 2**64
        assert (rel in splits["val"]) == (u < 0.3)
        assert split_of(Path(rel), 0.3) == ("val" if u < 0.3 else "train")
    assert corpus.info["python_version"] == platform.python_version()
    assert corpus.info["excluded_dirs"] == sorted(EXCLUDED_DIRS)


def test_corpus_split_depends_on_relative_path_only(tmp_path):
    _make_tree(tmp_path / "here")
    elsewhere = tmp_path / "elsewhere" / "deeper" / "lib"
    shutil.copytree(tmp_path / "here", elsewhere.parent / "lib")
    a = load_corpus(tmp_path / "here", val_fraction=0.3)
    b = load_corpus(elsewhere, val_fraction=0.3)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert {k: v for k, v in a.info.items() if k != "root"} == {k: v for k, v in b.info.items() if k != "root"}
    # Each file's split ignores which other files exist: a tree with half of them.
    half = INCLUDED[::2]
    _make_tree(tmp_path / "half", half)
    c = load_corpus(tmp_path / "half", val_fraction=0.3)
    full, part = _splits(a), _splits(c)
    assert part["val"] == full["val"] & set(half) and part["train"] == full["train"] & set(half)


def test_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="root must be an existing directory"):
        load_corpus(tmp_path / "missing")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="root must be an existing directory"):
        load_corpus(tmp_path / "afile")
    _make_tree(tmp_path / "tree")
    for bad in (0.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="val_fraction must be a finite number > 0"):
            load_corpus(tmp_path / "tree", val_fraction=bad)
    for bad in (1.0, 1.5):
        with pytest.raises(ValueError, match=r"val_fraction must lie in \(0, 1\)"):
            load_corpus(tmp_path / "tree", val_fraction=bad)
    with pytest.raises(TypeError, match="val_fraction"):
        load_corpus(tmp_path / "tree", val_fraction="0.1")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has 0 .py files, too few"):
        load_corpus(tmp_path / "empty")
    _make_tree(tmp_path / "one", ["only.py"] + EXCLUDED + NOT_PY)
    with pytest.raises(ValueError, match="has 1 .py files, too few"):
        load_corpus(tmp_path / "one")


def test_stdlib_corpus(stdlib):
    info = stdlib.info
    assert info["python_version"] == platform.python_version()
    assert info["python_implementation"] == platform.python_implementation()
    assert info["files"]["train"] > 0 and info["files"]["val"] > 0
    assert info["bytes"] == {"train": stdlib.train.size, "val": stdlib.val.size}
    files = stdlib_files()
    assert info["files"]["train"] + info["files"]["val"] == len(files)
    assert Path("os.py") in files
    assert not any(set(p.parts) & EXCLUDED_DIRS for p in files)
    # The retrieval task's markers never occur in the text.
    for split in (stdlib.train, stdlib.val):
        assert not np.isin(split, [KEY_OPEN, KEY_CLOSE]).any()


# ---------------------------------------------------------------------------------------
# batches


def _text(n: int = 5000, seed: int = 0) -> np.ndarray:
    """Printable random bytes: no control bytes, and every window is unique."""
    return np.random.default_rng(seed).integers(32, 127, size=n, dtype=np.uint8)


def _rows(x, y):
    """The full windows ``(batch, seq_len + 1)`` behind a batch."""
    return torch.cat([x, y[:, -1:]], dim=1)


def test_sample_batch_deterministic_and_shifted():
    data = _text()
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(3):  # the stream, not just the first batch
        x1, y1 = sample_batch(data, 8, 32, g1, retrieval_fraction=0.5)
        x2, y2 = sample_batch(data, 8, 32, g2, retrieval_fraction=0.5)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (8, 32) and x1.dtype == torch.int64
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    x3, _ = sample_batch(data, 8, 32, torch.Generator().manual_seed(6), retrieval_fraction=0.5)
    assert not torch.equal(x1, x3)
    # without the mix every row is a window of the data
    x, y = sample_batch(data, 16, 32, torch.Generator().manual_seed(0))
    all_windows = torch.from_numpy(np.lib.stride_tricks.sliding_window_view(data, 33).astype(np.int64))
    for row in _rows(x, y):
        assert (all_windows == row).all(1).any()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_sample_batch_ranks_partition_the_global_batch(world, fraction):
    data = _text()
    one = torch.Generator().manual_seed(3)
    ranks = [torch.Generator().manual_seed(3) for _ in range(world)]
    for _ in range(3):
        x, y = sample_batch(data, 8, 32, one, retrieval_fraction=fraction)
        parts = [sample_batch(data, 8, 32, g, retrieval_fraction=fraction, rank=r, world_size=world)
                 for r, g in enumerate(ranks)]
        joined_x, joined_y = torch.empty_like(x), torch.empty_like(y)
        for r, (px, py) in enumerate(parts):
            assert px.shape == (8 // world, 32)
            joined_x[r::world], joined_y[r::world] = px, py
        assert torch.equal(joined_x, x) and torch.equal(joined_y, y)


@pytest.mark.parametrize("queries", [1, 3])
def test_sample_batch_retrieval_mix(queries):
    data = _text()
    x, y = sample_batch(data, 64, 32, torch.Generator().manual_seed(1), retrieval_fraction=1.0,
                        retrieval_queries=queries)
    keys, last_queries = [], []
    for row in _rows(x, y).tolist():
        opens = [i for i, b in enumerate(row) if b == KEY_OPEN]
        closes = [i for i, b in enumerate(row) if b == KEY_CLOSE]
        assert len(opens) == 1 + queries and len(closes) == 1, row
        k, qs = opens[0], opens[1:]
        assert closes == [k + 1 + KEY_DIGITS]
        digits = row[k + 1: k + 1 + KEY_DIGITS]
        assert set(digits) <= DIGITS
        # every query later than the key, none overlapping another, the last one whole
        assert qs[0] >= k + KEY_LEN
        assert all(b - a >= QUERY_LEN for a, b in zip(qs, qs[1:]))
        assert qs[-1] + QUERY_LEN <= len(row)
        for q in qs:
            assert row[q + 1: q + 1 + KEY_DIGITS] == digits
        keys.append(k)
        last_queries.append(qs[-1])
    # keys and queries are spread over the window, not pinned to one place
    assert min(keys) < 8 and max(last_queries) > 33 - QUERY_LEN - 8


def test_sample_batch_without_the_mix_and_with_a_fraction():
    data = _text()
    x, y = sample_batch(data, 64, 32, torch.Generator().manual_seed(1), retrieval_fraction=0.0)
    assert not torch.isin(_rows(x, y), torch.tensor([KEY_OPEN, KEY_CLOSE])).any()
    # a fraction: rows with a key ~ Binomial(400, 0.25), mean 100, sd 8.7; 4.6 sd either side
    x, y = sample_batch(data, 400, 32, torch.Generator().manual_seed(2), retrieval_fraction=0.25)
    with_key = int((_rows(x, y) == KEY_CLOSE).any(1).sum())
    assert 60 <= with_key <= 140


def test_sample_batch_errors():
    data, g = _text(), torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=r"batch_size \(6\) must be a multiple of world_size \(4\)"):
        sample_batch(data, 6, 32, g, world_size=4)
    with pytest.raises(ValueError, match="world_size"):
        sample_batch(data, 4, 32, g, world_size=0)
    with pytest.raises(ValueError, match="rank"):
        sample_batch(data, 4, 32, g, rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        sample_batch(data, 4, 32, g, rank=-1, world_size=2)
    for name, args in (("batch_size", (0, 32)), ("seq_len", (4, 0))):
        with pytest.raises(ValueError, match=name):
            sample_batch(data, *args, g)
    with pytest.raises(ValueError, match="33 bytes"):
        sample_batch(data[:33], 4, 32, g)
    with pytest.raises(ValueError, match="retrieval_queries"):
        sample_batch(data, 4, 32, g, retrieval_fraction=0.5, retrieval_queries=0)
    with pytest.raises(ValueError, match="for a key and 3 queries"):
        sample_batch(data, 4, KEY_LEN + 3 * QUERY_LEN - 2, g, retrieval_fraction=0.5, retrieval_queries=3)
    # a window of seq_len + 1 bytes must hold a key and a query
    short = KEY_LEN + QUERY_LEN - 2
    with pytest.raises(ValueError, match="seq_len must be at least"):
        sample_batch(data, 4, short, g, retrieval_fraction=0.5)
    x, _ = sample_batch(data, 4, short, g)  # no mix: any length works
    assert x.shape == (4, short)


# ---------------------------------------------------------------------------------------
# schemes


SHAPE = dict(d_model=16, n_heads=2, max_len=64, train_len=32)


@pytest.mark.parametrize("name", list(BUILTIN))
def test_builtin_schemes_build_and_run(name):
    scheme = build_scheme(name, **SHAPE)
    assert isinstance(scheme, PositionScheme)
    torch.manual_seed(0)
    model = TinyDecoder(256, 16, 2, 1, scheme=scheme)
    logits = model(torch.randint(0, 256, (2, 64)))  # up to max_len
    assert logits.shape == (2, 64, 256) and torch.isfinite(logits).all()
    assert scheme_label(name) == LABELS[name]


def test_builtin_names_have_labels():
    assert list(LABELS) == list(BUILTIN)


def test_rope_nope_keeps_every_second_layer_without_positions():
    from companion.lab import build_model
    from companion.lab.schemes import NOPE_LAYERS, nope_layers_for
    assert set(NOPE_LAYERS) <= set(BUILTIN)
    assert nope_layers_for("rope-nope", 4) == (1, 3) and nope_layers_for("rope", 4) == ()
    model = build_model(TrainConfig(scheme="rope-nope", n_layers=2, steps=10))
    assert [type(b.attn.scheme).__name__ for b in model.blocks] == ["RotaryEmbedding", "NoPE"]
    assert type(build_model(TrainConfig(scheme="rope", steps=10)).blocks[1].attn.scheme).__name__ == "RotaryEmbedding"


def test_prope_short_keeps_only_pairs_that_turn_fully_in_training():
    # the lab's head: head_dim 16, base 1e4, L = 128
    scheme = build_scheme("p-rope-0.375", d_model=64, n_heads=4, max_len=2048, train_len=128)
    theta = scheme.inv_freq.double()
    kept = theta > 0
    assert int(kept.sum()) == 3                       # int(0.375 * 16 // 2)
    wavelength = 2 * math.pi / theta[kept]
    assert bool((wavelength <= 128).all())            # every rotating pair turns fully within L
    full = 2 * math.pi / (10000.0 ** (-torch.arange(8, dtype=torch.float64) / 8))
    assert float(full[3]) > 128                       # and the next pair would not
    assert torch.equal(theta[kept], build_scheme("rope", d_model=64, n_heads=4, max_len=2048,
                                                 train_len=128).inv_freq.double()[:3])


def test_alibi_learned_starts_at_alibi_and_learns_only_its_slopes():
    from companion import ALiBi, alibi_slopes
    scheme = build_scheme("alibi-learned", d_model=64, n_heads=4, max_len=2048, train_len=128)
    pos = torch.arange(40)
    causal = pos[None, :] <= pos[:, None]
    ours = scheme.bias(pos, pos)
    ref = ALiBi(4).bias(pos, pos)
    # the same function on every entry a causal mask keeps: -m_h (i - j), with r2 = 1 exactly
    assert torch.equal(ours.masked_fill(~causal, 0), ref.masked_fill(~causal, 0).to(ours.dtype))
    assert torch.equal(scheme.r1.detach(), alibi_slopes(4)) and not scheme.r2.requires_grad
    model = TinyDecoder(256, 64, 4, 1, scheme=scheme)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        loss = model.loss(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(scheme.r1).all() and not torch.equal(scheme.r1.detach(), alibi_slopes(4))
    assert bool((scheme.r2 == 1).all())


def test_user_scheme_by_import_path():
    scheme = build_scheme(USER_SCHEME, **SHAPE)
    assert type(scheme) is lab_user_scheme.LongBaseRotary
    # exactly the arguments the constructor names; its keyword-only default is kept
    assert scheme.received == {"head_dim": 8, "max_len": 64, "base_factor": 10.0}
    assert scheme.hooks() == ("rotate",)
    assert scheme_label(USER_SCHEME) == "LongBaseRotary"
    torch.manual_seed(0)
    model = TinyDecoder(256, 16, 2, 1, scheme=scheme)
    ids = torch.randint(0, 256, (2, 40))
    logits = model(ids)
    assert logits.shape == (2, 40, 256) and torch.isfinite(logits).all()
    # the rotation is really applied: the same weights without it give other logits
    plain = TinyDecoder(256, 16, 2, 1)
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(plain(ids), logits)


def test_build_scheme_errors():
    with pytest.raises(ValueError, match=r"built-in name .* or 'package.module:ClassName', got 'ropee'"):
        build_scheme("ropee", **SHAPE)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_for_lab'"):
        build_scheme("no_such_module_for_lab:Thing", **SHAPE)
    with pytest.raises(ValueError, match="must be a subclass of companion.PositionScheme, got type"):
        build_scheme("lab_user_scheme:NotAScheme", **SHAPE)
    with pytest.raises(ValueError, match="must be a subclass of companion.PositionScheme, got nothing"):
        build_scheme("lab_user_scheme:Missing", **SHAPE)
    with pytest.raises(ValueError, match=r"needs \['width'\]"):
        build_scheme("lab_user_scheme:NeedsWidth", **SHAPE)
    for bad in ("lab_user_scheme:", ":LongBaseRotary", "a:b:c"):
        with pytest.raises(ValueError, match="package.module:ClassName"):
            build_scheme(bad, **SHAPE)
    with pytest.raises(TypeError, match="scheme must be a string"):
        build_scheme(None, **SHAPE)


# ---------------------------------------------------------------------------------------
# learning-rate schedule and config


def test_lr_schedule():
    cfg = TrainConfig(steps=50, warmup=5, lr=0.01, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(cfg.steps)]
    # warmup: lr / warmup, 2 lr / warmup, ..., lr
    assert lrs[:5] == pytest.approx([0.002, 0.004, 0.006, 0.008, 0.010], rel=1e-12)
    assert lrs[5] == pytest.approx(0.01, rel=1e-12)
    # cosine: halfway through the decay (step 5 + 44 / 2) the mean of lr and min_lr
    assert lrs[27] == pytest.approx(0.01 * (0.1 + 0.9 * 0.5), rel=1e-12)
    assert lrs[-1] == pytest.approx(0.001, rel=1e-12)
    after = lrs[5:]
    assert all(a > b for a, b in zip(after, after[1:]))  # strictly decreasing
    assert lr_at(0, TrainConfig(steps=10, warmup=0, lr=0.02)) == 0.02


@pytest.mark.parametrize(
    "field, value, error",
    [("d_model", 0, ValueError), ("n_heads", 0, ValueError), ("n_layers", 0, ValueError),
     ("seq_len", 0, ValueError), ("max_len", 0, ValueError), ("batch_size", 0, ValueError),
     ("steps", 0, ValueError), ("seed", -1, ValueError), ("warmup", -1, ValueError),
     ("d_model", 16.0, TypeError), ("steps", "10", TypeError),
     ("lr", 0.0, ValueError), ("lr", float("nan"), ValueError), ("grad_clip", 0.0, ValueError),
     ("min_lr_ratio", 1.5, ValueError), ("min_lr_ratio", -0.1, ValueError),
     ("retrieval_fraction", 2.0, ValueError), ("retrieval_queries", 0, ValueError),
     ("weight_decay", -1.0, ValueError),
     ("dtype", "float16", ValueError)],
)
def test_train_config_errors(field, value, error):
    with pytest.raises(error, match=field):
        TrainConfig(**{field: value})


def test_train_config_cross_field_errors():
    with pytest.raises(ValueError, match=r"d_model \(10\) must be a multiple of n_heads \(4\)"):
        TrainConfig(d_model=10, n_heads=4)
    with pytest.raises(ValueError, match=r"max_len \(16\) must be at least seq_len \(32\)"):
        TrainConfig(seq_len=32, max_len=16)
    with pytest.raises(ValueError, match=r"unknown TrainConfig fields \['stepz'\]"):
        TrainConfig.from_dict({"stepz": 3})
    cfg = TrainConfig(**TINY)
    assert TrainConfig.from_dict(vars(cfg)) == cfg


# ---------------------------------------------------------------------------------------
# training


def test_train_learns_checkpoints_and_resumes(stdlib, tmp_path):
    cfg = TrainConfig(scheme="rope", steps=30, warmup=3, **TINY)
    path = tmp_path / "run.pt"
    model, record = train(cfg, stdlib, checkpoint=path, log_every=1, progress=False)
    losses = [e["loss"] for e in record["log"]]
    assert [e["step"] for e in record["log"]] == list(range(1, 31))
    # At initialisation the logits are nearly equal, so the first loss is close to
    # log2 256 = 8 bits (measured 7.90-7.98). After 30 steps the model has learned roughly
    # the byte frequencies (the training split's unigram entropy is 4.7 bits): the mean of
    # the last 5 batch losses measured 5.01-5.28 bits over seeds 0-3 and schemes nope, rope,
    # t5, alibi, a drop of 2.66-2.91 bits. One batch's loss (128 bytes) varies by 0.14-0.26
    # bits (sd of the last 10), so the mean of 5 by about 0.1: requiring a drop of 2 bits
    # leaves more than 6 of those spreads below the smallest drop measured.
    assert losses[0] > 7.5
    assert np.mean(losses[-5:]) < losses[0] - 2.0
    assert record["world_size"] == 1
    assert record["parameters"] == sum(p.numel() for p in model.parameters())
    assert record["provenance"]["corpus"] == stdlib.info

    # The checkpoint loads with weights_only=True into identical parameters and outputs.
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert raw["step"] == 30 and raw["config"] == vars(cfg) and raw["info"]["corpus"] == stdlib.info
    loaded, ckpt = load_checkpoint(path)
    assert not loaded.training
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    assert all(torch.equal(state[k], loaded_state[k]) for k in state)
    ids = torch.from_numpy(stdlib.val[:2 * 64].astype(np.int64)).view(2, 64)
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))
    assert ckpt["log"] == record["log"]

    # Same path and config: resumes at step 30, so no step runs and nothing changes.
    t0 = time.perf_counter()
    again, record2 = train(cfg, stdlib, checkpoint=path, log_every=1, progress=False)
    resume_wall = time.perf_counter() - t0
    assert record2["log"] == record["log"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    # the resumed record keeps the training time the checkpoint had spent, and adds no more
    # than the resumed call itself took (structural: no bound on the machine's speed)
    assert record["seconds"] <= record2["seconds"] <= record["seconds"] + resume_wall
    assert torch.load(path, map_location="cpu", weights_only=True)["step"] == 30

    # Seeded: the same config without a checkpoint trains to the same weights bit for bit.
    fresh, record3 = train(cfg, stdlib, log_every=1, progress=False)
    assert record3["log"] == record["log"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


def test_train_does_not_resume_another_config(stdlib, tmp_path):
    path = tmp_path / "run.pt"
    cfg = TrainConfig(scheme="nope", steps=4, warmup=1, **TINY)
    train(cfg, stdlib, checkpoint=path, progress=False)
    longer = TrainConfig(scheme="nope", steps=6, warmup=1, **TINY)
    _, record = train(longer, stdlib, checkpoint=path, log_every=1, progress=False)
    assert [e["step"] for e in record["log"]] == [1, 2, 3, 4, 5, 6]  # from scratch
    assert torch.load(path, map_location="cpu", weights_only=True)["config"] == vars(longer)


# ---------------------------------------------------------------------------------------
# evaluations, on models whose answer is known


class ConstantLogits(nn.Module):
    """Every position gets the same logits, whatever the input: no content, no position."""

    def forward(self, idx):
        return torch.full((*idx.shape, 256), 1.5)


class RampModel(nn.Module):
    """On the ramp ``data[j] = j % 256``, a model that knows the next byte from position
    ``start`` of each window on: there it gives the next byte probability 1/2 (logit
    ``ln 255`` against 255 zeros: 1 bit), before it all logits are 0 (8 bits)."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start = start

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, 256)
        nxt = (idx[:, self.start:] + 1) % 256
        logits[:, self.start:].scatter_(-1, nxt[..., None], math.log(255.0))
        return logits


ULPS_8 = 2 * 2.0**-20  # two float32 ulps of 8


def test_bits_per_byte_constant_logits_is_8():
    data = _text(20_000)
    model = ConstantLogits()
    # log_softmax subtracts the max first, so every position's loss is log(256) / ln 2,
    # which is 8.0 in float32 here; the mean of equal numbers is that number. The tolerance
    # allows log(256) and ln 2 to round differently on another machine (2 ulps of 8).
    res = bits_per_byte(model, data, [16, 100, 300], windows_per_length=32, blocks=4)
    assert set(res) == {16, 100, 300}
    for v in res.values():
        assert set(v) == {"all", "tail", "all_blocks", "tail_blocks"}
        assert v["all"] == pytest.approx(8.0, abs=ULPS_8) and v["tail"] == pytest.approx(8.0, abs=ULPS_8)
        for key in ("all_blocks", "tail_blocks"):
            assert len(v[key]) == 4 and v[key] == pytest.approx([8.0] * 4, abs=ULPS_8)
    sl = sliding_bits_per_byte(model, data, [16, 100], scored_tokens=512, blocks=8)
    assert set(sl) == {16, 100}
    for v in sl.values():
        assert set(v) == {"sliding", "sliding_blocks"}
        assert v["sliding"] == pytest.approx(8.0, abs=ULPS_8)
        assert len(v["sliding_blocks"]) == 8 and v["sliding_blocks"] == pytest.approx([8.0] * 8, abs=ULPS_8)


def test_bits_per_byte_windows_score_the_right_positions():
    data = (np.arange(50_000) % 256).astype(np.uint8)
    model = RampModel(start=40)
    # Exact per position: 8 bits before position 40, 1 bit from 40 on (float32 rounding of
    # log(2 * 255) and the mean: well under 1e-5).
    res = bits_per_byte(model, data, [32, 64, 128], windows_per_length=32, blocks=4)
    assert res[32]["all"] == pytest.approx(8.0, abs=1e-5)
    assert res[32]["tail"] == pytest.approx(8.0, abs=1e-5)  # the whole window is the tail
    assert res[64]["all"] == pytest.approx((40 * 8 + 24) / 64, abs=1e-5)
    assert res[64]["tail"] == pytest.approx((40 * 8 + 24) / 64, abs=1e-5)
    assert res[128]["all"] == pytest.approx((40 * 8 + 88) / 128, abs=1e-5)
    assert res[128]["tail"] == pytest.approx(1.0, abs=1e-5)  # positions 64..127
    # every window scores the same positions, so every block has the window's mean
    for w in (32, 64, 128):
        for key in ("all", "tail"):
            assert res[w][f"{key}_blocks"] == pytest.approx([res[w][key]] * 4, abs=1e-5)
    # sliding: stride W / 4, the last W / 4 positions scored (24..31; 48..63; 96..127)
    sl = sliding_bits_per_byte(model, data, [32, 64, 128], scored_tokens=1024, blocks=8)
    assert sl[32]["sliding"] == pytest.approx(8.0, abs=1e-5)
    assert sl[64]["sliding"] == pytest.approx(1.0, abs=1e-5) and sl[128]["sliding"] == pytest.approx(1.0, abs=1e-5)
    assert sl[32]["sliding_blocks"] == pytest.approx([8.0] * 8, abs=1e-5)
    assert sl[128]["sliding_blocks"] == pytest.approx([1.0] * 8, abs=1e-5)
    with pytest.raises(ValueError, match="too short"):
        sliding_bits_per_byte(model, data[:500], [64], scored_tokens=4096, blocks=8)


class UnigramLogits(nn.Module):
    """The same non-uniform distribution at every position: a byte's loss depends on the byte
    alone, so two evaluations agree exactly when they score the same bytes."""

    def forward(self, idx):
        return torch.linspace(-3.0, 3.0, 256).expand(*idx.shape, 256)


def _unigram_bits() -> np.ndarray:
    """UnigramLogits' loss of each byte value in bits, in float64 (from its float32 logits)."""
    logits = torch.linspace(-3.0, 3.0, 256).double()
    return ((torch.logsumexp(logits, 0) - logits) / math.log(2)).numpy()


#: How far a float32 mean of UnigramLogits' losses may be from its float64 value. Each loss
#: (5.4 to 14.1 bits) is a float32 log-softmax of logits in [-3, 3]: a few ulps of 14 (2**-20
#: each, ~4e-6 for four); torch's CPU sum is a cascade (pairwise) sum, so the mean of at
#: most 2**13 of them adds about log2(n) = 13 roundings of 2**-24 relative (~1e-5 of 14).
#: Measured: under 3e-6. The same bytes summed in another order (another length) differ by
#: the second part only, 1e-5.
UNIGRAM_F64 = 2e-5
UNIGRAM_ORDER = 1e-5


def test_tail_scores_the_same_bytes_at_every_length():
    data = np.random.default_rng(0).integers(0, 256, 60_000).astype(np.uint8)
    model, bits = UnigramLogits(), _unigram_bits()
    lengths, count, blocks = [64, 128, 256, 512], 64, 8
    res = bits_per_byte(model, data, lengths, windows_per_length=count, blocks=blocks)
    # the documented windows: at length W, data[e - W : e + 1] for the shared ends e, and
    # the tail is the bytes e - 63 .. e at every length
    ends = shared_ends(data.size, max(lengths), count).numpy()
    assert len(set(ends.tolist())) == count and ends.min() >= max(lengths) and ends.max() <= data.size - 1
    tail = bits[np.stack([data[e - 63: e + 1] for e in ends])]  # (count, 64) float64 losses
    for w in lengths:
        assert res[w]["tail"] == pytest.approx(tail.mean(), abs=UNIGRAM_F64), w
        whole = bits[np.stack([data[e - w + 1: e + 1] for e in ends])]
        assert res[w]["all"] == pytest.approx(whole.mean(), abs=UNIGRAM_F64), w
        # block b is the mean over windows b * 8 .. b * 8 + 7: consecutive ends
        assert res[w]["tail_blocks"] == pytest.approx(tail.reshape(blocks, -1).mean(1).tolist(), abs=UNIGRAM_F64)
        assert res[w]["all_blocks"] == pytest.approx(whole.reshape(blocks, -1).mean(1).tolist(), abs=UNIGRAM_F64)
        # equal runs of windows: the block means average to the overall mean
        assert np.mean(res[w]["tail_blocks"]) == pytest.approx(res[w]["tail"], abs=UNIGRAM_ORDER)
        assert np.mean(res[w]["all_blocks"]) == pytest.approx(res[w]["all"], abs=UNIGRAM_ORDER)
    tails = [res[w]["tail"] for w in lengths]
    assert max(tails) - min(tails) < UNIGRAM_ORDER
    for b in range(blocks):
        column = [res[w]["tail_blocks"][b] for w in lengths]
        assert max(column) - min(column) < UNIGRAM_ORDER
    # "all" covers W bytes, other bytes at each length (the test can tell lengths apart)
    assert abs(res[512]["all"] - res[64]["all"]) > 100 * UNIGRAM_F64
    # and they are the bytes at those ends: the same data shifted by one byte puts other
    # bytes at the ends, which changes the tail by far more than the rounding
    moved = data[1:]
    shifted = bits_per_byte(model, moved, lengths, windows_per_length=count, blocks=blocks)
    moved_tail = bits[np.stack([moved[e - 63: e + 1] for e in shared_ends(moved.size, max(lengths), count)])]
    assert abs(moved_tail.mean() - tail.mean()) > 20 * UNIGRAM_F64
    for w in lengths:
        assert shifted[w]["tail"] == pytest.approx(moved_tail.mean(), abs=UNIGRAM_F64)
        assert abs(shifted[w]["tail"] - res[w]["tail"]) > 20 * UNIGRAM_F64


def test_reach_makes_single_length_calls_score_the_same_windows():
    data = np.random.default_rng(1).integers(0, 256, 20_000).astype(np.uint8)
    lengths, kw = [16, 64, 200], dict(windows_per_length=32, blocks=4)
    for model in (RampModel(start=40), UnigramLogits()):  # UnigramLogits' joint is used below
        joint = bits_per_byte(model, data, lengths, **kw)
        assert joint == bits_per_byte(model, data, lengths, reach=200, **kw)  # the default reach
        for w in lengths:
            # the same rows through the same batches: the same floats, bit for bit
            assert bits_per_byte(model, data, [w], reach=200, **kw) == {w: joint[w]}
    # without it a single length's ends start after its own context: other bytes
    alone = bits_per_byte(UnigramLogits(), data, [64], **kw)
    assert abs(alone[64]["tail"] - joint[64]["tail"]) > 100 * UNIGRAM_F64
    # a longer reach moves the ends (and keeps them shared by the lengths)
    far = bits_per_byte(UnigramLogits(), data, lengths, reach=5000, **kw)
    assert abs(far[64]["tail"] - joint[64]["tail"]) > 100 * UNIGRAM_F64
    assert max(far[w]["tail"] for w in (64, 200)) - min(far[w]["tail"] for w in (64, 200)) < UNIGRAM_ORDER


def test_bits_per_byte_argument_errors():
    data, model = _text(2000), ConstantLogits()
    with pytest.raises(ValueError, match=r"blocks \(5\) must divide windows_per_length \(32\)"):
        bits_per_byte(model, data, [16], windows_per_length=32, blocks=5)
    with pytest.raises(ValueError, match="blocks"):
        bits_per_byte(model, data, [16], windows_per_length=32, blocks=0)
    with pytest.raises(ValueError, match="windows_per_length"):
        bits_per_byte(model, data, [16], windows_per_length=0, blocks=1)
    with pytest.raises(ValueError, match=r"reach \(63\) must be at least the longest length \(64\)"):
        bits_per_byte(model, data, [16, 64], windows_per_length=32, blocks=4, reach=63)
    with pytest.raises(ValueError, match="lengths must hold at least one length"):
        bits_per_byte(model, data, [], windows_per_length=32, blocks=4)
    with pytest.raises(ValueError, match="lengths"):
        bits_per_byte(model, data, [16, 0], windows_per_length=32, blocks=4)
    # distinct ends after the first `reach` bytes: data.size - reach of them at most
    assert shared_ends(2000, 1968, 32).tolist() == list(range(1968, 2000))
    assert len(bits_per_byte(model, data, [1968], windows_per_length=32, blocks=4)[1968]["tail_blocks"]) == 4
    with pytest.raises(ValueError, match=r"data \(2000 bytes\) is too short for 32 windows .* at most 31"):
        bits_per_byte(model, data, [1969], windows_per_length=32, blocks=4)
    with pytest.raises(ValueError, match="too short"):
        bits_per_byte(model, data, [16], windows_per_length=32, blocks=4, reach=1990)
    with pytest.raises(ValueError, match="blocks"):
        sliding_bits_per_byte(model, data, [16], scored_tokens=64, blocks=0)
    with pytest.raises(ValueError, match="lengths must hold at least one length"):
        sliding_bits_per_byte(model, data, [], scored_tokens=64, blocks=4)


def test_sliding_scores_the_same_bytes_at_every_length():
    data = np.random.default_rng(0).integers(0, 256, 60_000).astype(np.uint8)
    model, bits = UnigramLogits(), _unigram_bits()
    lengths, blocks, scored = [32, 64, 128, 256], 8, 2048
    sl = sliding_bits_per_byte(model, data, lengths, scored_tokens=scored, blocks=blocks)
    # identical multisets of bytes: only the order of the float32 sums differs
    means = [sl[w]["sliding"] for w in lengths]
    assert max(means) - min(means) < UNIGRAM_ORDER
    # ... stretch by stretch too: each block is one stretch of scored // blocks bytes
    span = scored // blocks
    for b in range(blocks):
        column = [sl[w]["sliding_blocks"][b] for w in lengths]
        assert max(column) - min(column) < UNIGRAM_ORDER
    for w in lengths:
        assert len(sl[w]["sliding_blocks"]) == blocks
        assert np.mean(sl[w]["sliding_blocks"]) == pytest.approx(sl[w]["sliding"], abs=UNIGRAM_ORDER)
    # Each block is the mean of one stretch data[s + 1 : s + span + 1] (the predictions of
    # the windows ending s + S, s + 2 S, ...), the stretches spread evenly, in order, after
    # the longest context (s >= 256): at the documented spacing, give or take a byte of rounding.
    reach = max(span, 256 // 4)
    free = data.size - max(lengths) - reach - 1
    for b, got in enumerate(sl[32]["sliding_blocks"]):
        near = round(max(lengths) + b * free / (blocks - 1))
        options = [bits[data[s + 1: s + span + 1]].mean() for s in range(max(max(lengths), near - 1), near + 2)]
        assert min(abs(got - o) for o in options) < UNIGRAM_F64, b
    # and they are not the bytes at the front of the data: a shifted copy changes the result
    # unless the stretches move with it (the stretches start after the longest context)
    shifted = sliding_bits_per_byte(model, data[1000:], lengths, scored_tokens=scored, blocks=blocks)
    assert abs(shifted[32]["sliding"] - sl[32]["sliding"]) > 1e-4


def test_sliding_reach_makes_single_length_calls_score_the_same_bytes():
    data = np.random.default_rng(2).integers(0, 256, 20_000).astype(np.uint8)
    lengths, kw = [32, 64, 128], dict(scored_tokens=1024, blocks=8)
    for model in (RampModel(start=40), UnigramLogits()):  # UnigramLogits' joint is used below
        joint = sliding_bits_per_byte(model, data, lengths, **kw)
        assert joint == sliding_bits_per_byte(model, data, lengths, reach=128, **kw)  # the default reach
        for w in lengths:
            assert sliding_bits_per_byte(model, data, [w], reach=128, **kw) == {w: joint[w]}
    # without it a single length's stretches start after its own context: other bytes
    alone = sliding_bits_per_byte(UnigramLogits(), data, [32], **kw)
    assert abs(alone[32]["sliding"] - joint[32]["sliding"]) > 100 * UNIGRAM_F64
    with pytest.raises(ValueError, match=r"reach \(64\) must be at least the longest length \(128\)"):
        sliding_bits_per_byte(UnigramLogits(), data, lengths, reach=64, **kw)


class KeyOracle(nn.Module):
    """Finds the key (``KEY_OPEN`` five digits ``KEY_CLOSE``) in each row and, at the query
    (the row's last ``KEY_OPEN``), predicts each next digit as the key's with probability
    ``p`` and each of the 9 other digits with ``(1 - p) / 9``; non-digits get ~0. It records
    where each row's key sat and its digits, row by row in the order it saw them."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.key_at: list[int] = []
        self.keys: list[list[int]] = []

    def predicted(self, key: list[int]) -> list[int]:
        """The digits it puts probability ``p`` on, given the key's."""
        return key

    def forward(self, idx):
        digit_logits = torch.full((10,), math.log((1 - self.p) / 9))
        logits = torch.full((*idx.shape, 256), -1e4)
        for b, row in enumerate(idx.tolist()):
            opens = [i for i, t in enumerate(row) if t == KEY_OPEN]
            key = next(i for i in opens if row[i + 1 + KEY_DIGITS] == KEY_CLOSE)
            self.key_at.append(key)
            self.keys.append(row[key + 1: key + 1 + KEY_DIGITS])
            guess = self.predicted(self.keys[-1])
            query = opens[-1]
            for j in range(KEY_DIGITS):
                t = query + j
                if t < len(row):
                    logits[b, t, ord("0"): ord("9") + 1] = digit_logits
                    logits[b, t, guess[j]] = math.log(self.p)
        return logits


class ParityOracle(KeyOracle):
    """KeyOracle that copies a key only when its first digit is even; otherwise it is sure of
    the next digit up (mod 10) at each place, so the trial is never exact."""

    def predicted(self, key: list[int]) -> list[int]:
        if (key[0] - ord("0")) % 2 == 0:
            return key
        return [ord("0") + (d - ord("0") + 1) % 10 for d in key]


def test_passkey_retrieval_oracle():
    data = _text(20_000)
    p, trials, lengths, depths = 0.5, 20, [32, 96], [0.0, 0.5, 1.0]
    oracle = KeyOracle(p)
    res = passkey_retrieval(oracle, data, lengths, depths, trials=trials, seed=3)
    # the key sits at round(depth * (W - KEY_LEN - QUERY_LEN)), as documented
    expected_at = [round(d * (w - KEY_LEN - QUERY_LEN))
                   for w in lengths for d in depths for _ in range(2 * trials)]
    assert oracle.key_at == expected_at
    bit_gap = math.log2(p) - math.log2((1 - p) / 9)  # = log2 9: the cost of a wrong key, per digit
    n = KEY_DIGITS * trials
    assert np.shape(res["gain_trials"]) == np.shape(res["exact_trials"]) == (len(lengths), len(depths), trials)
    for i in range(len(lengths)):
        for j in range(len(depths)):
            # matching key: -log2 p per digit (float32 log-softmax of probabilities summing
            # to 1: a few ulps), and every argmax right
            assert res["bits"][i][j] == pytest.approx(-math.log2(p), abs=1e-5)
            assert res["exact"][i][j] == 1.0
            # Control key: a digit that differs costs -log2((1 - p) / 9), one that happens to
            # agree -log2 p. So gain = (1 - f) * log2 9 with f the fraction of agreeing digits,
            # a multiple of 1 / n; f ~ 0.1 for random digits (sd 0.03 at n = 100).
            agree = (1 - res["gain"][i][j] / bit_gap) * n
            assert agree == pytest.approx(round(agree), abs=1e-3)
            assert 0 <= round(agree) <= 0.3 * n
            assert res["control_bits"][i][j] - res["bits"][i][j] == pytest.approx(res["gain"][i][j], abs=1e-12)
            # Trial by trial: the same rule with 5 digits, and the trials average to the cell
            # (float32 means of values up to ~3 bits: a few ulps, 1e-5 is ample).
            per_trial = res["gain_trials"][i][j]
            assert all(type(g) is float for g in per_trial)
            agree_t = [(1 - g / bit_gap) * KEY_DIGITS for g in per_trial]
            assert agree_t == pytest.approx([round(a) for a in agree_t], abs=1e-4)
            assert sum(round(a) for a in agree_t) == round(agree)  # the same agreeing digits
            assert all(0 <= round(a) < KEY_DIGITS for a in agree_t)  # the control is never the key
            assert np.mean(per_trial) == pytest.approx(res["gain"][i][j], abs=1e-5)
            assert res["exact_trials"][i][j] == [1] * trials
            assert all(type(x) is int for x in res["exact_trials"][i][j])
    mean_gain = np.mean(res["gain"])
    assert 0.8 * bit_gap < mean_gain < bit_gap  # near 0.9 * log2 9 = 2.85 bits per digit
    # A confident copier pays more for the control's wrong key: the gain is not bounded by
    # log2 10 (p = 0.999: 0.9 * log2(9 * 999) = 11.8 bits per digit).
    confident = passkey_retrieval(KeyOracle(0.999), data, [32], [0.5], trials=trials, seed=3)
    assert confident["gain"][0][0] > 3 * math.log2(10)


def test_passkey_trials_record_each_trial():
    data = _text(20_000)
    p, trials, lengths, depths = 0.5, 16, [32, 64], [0.0, 1.0]
    oracle = ParityOracle(p)
    res = passkey_retrieval(oracle, data, lengths, depths, trials=trials, seed=7)
    assert np.shape(res["gain_trials"]) == np.shape(res["exact_trials"]) == (2, 2, trials)
    # The oracle saw each cell's true windows, then its controls (one batch each here), so
    # trial t's true key is keys[2 * trials * cell + t]: exact iff its first digit is even.
    bit_gap = math.log2(9.0)
    for cell, (i, j) in enumerate((i, j) for i in range(2) for j in range(2)):
        keys = oracle.keys[2 * trials * cell: 2 * trials * cell + trials]
        even = [int((k[0] - ord("0")) % 2 == 0) for k in keys]
        assert res["exact_trials"][i][j] == even
        assert all(type(x) is int for x in res["exact_trials"][i][j])
        assert 0 < sum(even) < trials  # a mix, so the per-trial record is tested
        # the exact-match rate is the mean of the trials (float32 of k / trials)
        assert res["exact"][i][j] == pytest.approx(sum(even) / trials, abs=1e-7)
        gains = res["gain_trials"][i][j]
        assert np.mean(gains) == pytest.approx(res["gain"][i][j], abs=1e-5)
        for t, g in enumerate(gains):
            if not even[t]:
                # sure of a wrong digit at every place: 5 digits at -log2((1 - p) / 9) for the
                # true key; its control (another key) may hit some digits by luck
                assert g <= 1e-5
            else:
                assert 0 < g <= bit_gap + 1e-5
    with pytest.raises(ValueError, match="trials"):
        passkey_retrieval(oracle, data, [32], [0.5], trials=0)


def test_passkey_retrieval_content_blind_model_gains_nothing():
    data = _text(20_000)
    res = passkey_retrieval(ConstantLogits(), data, [32, 64], [0.0, 1.0], trials=4)
    # identical logits for the true and the control windows: identical losses, bit for bit
    assert res["gain"] == [[0.0, 0.0], [0.0, 0.0]]
    assert res["bits"] == res["control_bits"]
    assert res["exact"] == [[0.0, 0.0], [0.0, 0.0]]  # argmax is byte 0, never a digit
    assert res["gain_trials"] == [[[0.0] * 4] * 2] * 2
    assert res["exact_trials"] == [[[0] * 4] * 2] * 2
    with pytest.raises(ValueError, match=f"lengths must be at least {KEY_LEN + QUERY_LEN}"):
        passkey_retrieval(ConstantLogits(), data, [KEY_LEN + QUERY_LEN - 1], [0.5])


def test_attention_entropy_uniform_attention():
    torch.manual_seed(0)
    model = TinyDecoder(256, 16, 2, 2)  # NoPE
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q_proj.weight.zero_()
            if block.attn.q_proj.bias is not None:
                block.attn.q_proj.bias.zero_()
    data = _text(20_000)
    tail = 16
    res = attention_entropy(model, data, [8, 40, 100], windows_per_length=2, tail=tail)
    # q = 0: every logit is 0, so query i attends its i + 1 keys uniformly: log2(i + 1) bits.
    # float32: each weight 1/(i+1) and each log2 carry ~1e-7 relative error, and the
    # entropy sums at most 100 such terms of size <= 0.07: well under 1e-5.
    for w, per_layer in res.items():
        expected = np.mean(np.log2(np.arange(max(0, w - tail), w) + 1.0))
        assert len(per_layer) == 2
        assert per_layer == pytest.approx([expected, expected], abs=1e-5)
    # A model with content-dependent attention is below the uniform bound.
    torch.manual_seed(1)
    other = TinyDecoder(256, 16, 2, 1)
    with torch.no_grad():
        other.blocks[0].attn.q_proj.weight.mul_(300)  # sharpen the attention
    res = attention_entropy(other, data, [40], windows_per_length=2, tail=tail)
    assert res[40][0] < np.mean(np.log2(np.arange(40 - tail, 40) + 1.0)) - 0.1


def test_attention_entropy_follows_the_models_own_forward():
    # attention_entropy runs the blocks itself (to get the weights); the weights it sees must
    # be those of the model's forward. Capture each layer's input in model(row) and ask that
    # layer for its weights (MultiHeadAttention with return_weights=True).
    torch.manual_seed(2)
    scheme = build_scheme("rope", d_model=16, n_heads=2, max_len=128, train_len=32)
    model = TinyDecoder(256, 16, 2, 2, scheme=scheme).eval()
    with torch.no_grad():
        for block in model.blocks:  # attention far from uniform
            block.attn.q_proj.weight.mul_(20)
            block.attn.k_proj.weight.mul_(20)
    data, w, tail, count = _text(20_000), 100, 16, 2
    got = attention_entropy(model, data, [w], windows_per_length=count, tail=tail)[w]
    seen = []
    for block in model.blocks:
        block.attn.register_forward_pre_hook(lambda m, args, kwargs: seen.append((m, *args[:2])),
                                             with_kwargs=True)
    expected = np.zeros(2)
    with torch.no_grad():
        for row in windows(data, evenly_spaced_starts(data.size, w, count), w).split(1):
            seen.clear()
            model(row)
            for layer, (attn, x, pos) in enumerate(list(seen)):
                weights = attn(x, pos, causal=True, return_weights=True)[1][..., -tail:, :].double()
                ent = -(weights * torch.log2(weights.clamp_min(1e-300))).sum(-1)
                expected[layer] += ent.mean().item() / count
    uniform = np.mean(np.log2(np.arange(w - tail, w) + 1.0))
    assert expected.max() < uniform - 0.5  # not the uniform case of the test above
    # The model's forward takes the fast attention path, attention_entropy the reference:
    # float32 rounding apart (~1e-6 relative in the first layer's output), which moves an
    # entropy below log2(100) = 6.6 bits by ~1e-5 at most.
    assert got == pytest.approx(expected.tolist(), abs=1e-4)


def test_evaluate_model_refuses_lengths_past_max_len(stdlib):
    cfg = TrainConfig(**TINY)
    with pytest.raises(ValueError, match=r"reaches length 128, past the config's max_len = 64"):
        evaluate_model(ConstantLogits(), cfg, EvalConfig(multiples=[1, 4], passkey_multiples=[1]), stdlib)
    with pytest.raises(ValueError, match=r"reaches length 96, past the config's max_len = 64"):
        evaluate_model(ConstantLogits(), cfg, EvalConfig(multiples=[1], passkey_multiples=[3]), stdlib)


#: A small evaluation: 8 windows in 4 blocks, 4 sliding stretches of 16 bytes, 3 trials.
SMALL_EV = dict(multiples=[1, 2], windows=8, blocks=4, sliding_tokens=64, passkey_multiples=[1],
                passkey_depths=[0.0, 0.5], passkey_trials=3, entropy_windows=1)


def _is_4_decimals(values) -> bool:
    return all(type(v) is float and v == round(v, 4) for v in values)


def test_evaluate_model_layout_with_blocks_and_trials(stdlib):
    from companion.lab.train import build_model
    cfg = TrainConfig(**{**TINY, "max_len": 128})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ev = EvalConfig(**{**SMALL_EV, "multiples": [1, 4]})  # 128 > TAIL: the tail is not the window
    out = evaluate_model(model, cfg, ev, stdlib)
    assert set(out) == {"eval", "eval_seconds"} and out["eval_seconds"] > 0
    e = out["eval"]
    assert json.loads(json.dumps(e)) == e  # plain JSON: string keys, lists, numbers
    assert set(e) == {"lengths", "bpb", "sliding_bpb", "blocks", "passkey", "entropy"}
    assert e["lengths"] == [32, 128]
    keys = {"32", "128"}
    assert set(e["bpb"]) == keys and all(set(v) == {"all", "tail"} for v in e["bpb"].values())
    assert set(e["sliding_bpb"]) == keys and all(type(v) is float for v in e["sliding_bpb"].values())
    assert set(e["blocks"]) == {"all", "tail", "sliding"}
    # the means are those of the evaluations themselves (the same computation, bit for bit),
    # and the blocks are theirs rounded to 4 decimals
    val = stdlib.val
    bpb = bits_per_byte(model, val, [32, 128], windows_per_length=8, blocks=4)
    sl = sliding_bits_per_byte(model, val, [32, 128], scored_tokens=64, blocks=4)
    assert bpb[128]["tail_blocks"] != bpb[128]["all_blocks"]
    for w in (32, 128):
        assert e["bpb"][str(w)] == {"all": bpb[w]["all"], "tail": bpb[w]["tail"]}
        assert e["sliding_bpb"][str(w)] == sl[w]["sliding"]
        for name, full in (("all", bpb[w]["all_blocks"]), ("tail", bpb[w]["tail_blocks"]),
                           ("sliding", sl[w]["sliding_blocks"])):
            got = e["blocks"][name][str(w)]
            assert len(got) == 4 and _is_4_decimals(got)
            assert got == [round(v, 4) for v in full]
        # rounding moves each block by at most 5e-5, so their mean stays that close to the mean
        assert np.mean(e["blocks"]["tail"][str(w)]) == pytest.approx(e["bpb"][str(w)]["tail"], abs=6e-5)
        assert np.mean(e["blocks"]["sliding"][str(w)]) == pytest.approx(e["sliding_bpb"][str(w)], abs=6e-5)
    pk = e["passkey"]
    assert pk["lengths"] == [32] and pk["depths"] == [0.0, 0.5]
    assert set(pk) == {"lengths", "depths", "bits", "control_bits", "gain", "exact", "gain_trials", "exact_trials"}
    assert np.shape(pk["gain"]) == (1, 2)
    assert np.shape(pk["gain_trials"]) == np.shape(pk["exact_trials"]) == (1, 2, 3)
    raw = passkey_retrieval(model, val, [32], [0.0, 0.5], trials=3, seed=cfg.seed)
    for j in range(2):
        assert _is_4_decimals(pk["gain_trials"][0][j])
        assert pk["gain_trials"][0][j] == [round(g, 4) for g in raw["gain_trials"][0][j]]
        assert pk["exact_trials"][0][j] == raw["exact_trials"][0][j]
        assert set(pk["exact_trials"][0][j]) <= {0, 1}
        assert pk["gain"][0][j] == raw["gain"][0][j]
    assert set(e["entropy"]) == keys and all(len(v) == 1 for v in e["entropy"].values())  # one layer


def test_run_job_reuses_a_finished_record(tmp_path, monkeypatch):
    import companion.lab.sweep as sweep
    cfg = TrainConfig(scheme="rope", steps=2, warmup=1, **TINY)
    ev = EvalConfig(**SMALL_EV)
    calls = []
    real = sweep.evaluate_model

    def counting(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "evaluate_model", counting)
    first = sweep.run_job(cfg, ev, str(tmp_path))
    assert len(calls) == 1 and "provenance" not in first and "eval_config" not in first
    ckpt = sweep.checkpoint_path(tmp_path, cfg)
    cached = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json")
    assert len(cached) == 1 and cached[0].startswith(ckpt.stem + ".eval-")
    assert json.loads((tmp_path / cached[0]).read_text())["eval_config"] == asdict(ev)
    # the same configs again: the stored record, without evaluating (or training) again
    again = sweep.run_job(cfg, ev, str(tmp_path))
    assert len(calls) == 1
    assert again == json.loads(json.dumps(first))
    # another evaluation config is another record (and the first one stays)
    other = EvalConfig(**{**SMALL_EV, "windows": 4})
    third = sweep.run_job(cfg, other, str(tmp_path))
    assert len(calls) == 2 and calls[-1] == other
    assert third["eval"] != first["eval"] and third["log"] == first["log"]
    assert len([p for p in tmp_path.iterdir() if p.suffix == ".json"]) == 2
    assert sweep.run_job(cfg, ev, str(tmp_path)) == again and len(calls) == 2
    # a record is reused only beside its checkpoint: without it the job runs again
    ckpt.unlink()
    sweep.run_job(cfg, ev, str(tmp_path))
    assert len(calls) == 3
    # no checkpoint_dir: nothing stored, always evaluated
    sweep.run_job(cfg, ev, None)
    assert len(calls) == 4


# ---------------------------------------------------------------------------------------
# command line


TINY_FLAGS = ["--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--seq-len", "32",
              "--batch-size", "4", "--max-len", "64", "--warmup", "1"]
EVAL_FLAGS = ["--multiples", "1", "2", "--passkey-multiples", "1", "--passkey-depths", "0.5",
              "--passkey-trials", "2", "--windows", "8", "--blocks", "4", "--sliding-tokens", "64",
              "--entropy-windows", "1"]


def _lab(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "companion.lab", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_cli_sweep_with_a_user_scheme(tmp_path):
    out = tmp_path / "s.json"
    _lab("sweep", "--schemes", "nope", USER_SCHEME, "--seeds", "0", "--workers", "1",
         "--steps", "3", *TINY_FLAGS, *EVAL_FLAGS,
         "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(out))
    payload = load_result(out)
    prov, data = payload["provenance"], payload["data"]
    assert prov["command"].startswith("python -m companion.lab sweep --schemes nope " + USER_SCHEME)
    assert prov["python"] == platform.python_version() and "torch_threads" in prov
    assert data["corpus"]["python_version"] == platform.python_version()
    assert data["corpus"]["files"]["train"] > 0 and data["corpus"]["files"]["val"] > 0
    assert [r["config"]["scheme"] for r in data["runs"]] == ["nope", USER_SCHEME]
    assert [scheme_label(r["config"]["scheme"]) for r in data["runs"]] == ["NoPE", "LongBaseRotary"]
    for run in data["runs"]:
        assert run["config"]["steps"] == 3 and run["config"]["d_model"] == 16
        assert run["log"][-1]["step"] == 3 and math.isfinite(run["log"][-1]["loss"])
        ev = run["eval"]
        assert set(ev) == {"lengths", "bpb", "sliding_bpb", "blocks", "passkey", "entropy"}
        assert ev["lengths"] == [32, 64]
        assert set(ev["bpb"]) == {"32", "64"} and set(ev["bpb"]["32"]) == {"all", "tail"}
        assert set(ev["sliding_bpb"]) == {"32", "64"}
        # --blocks 4: four units per metric and length
        assert {k: {w: len(v) for w, v in per.items()} for k, per in ev["blocks"].items()} == \
            {k: {"32": 4, "64": 4} for k in ("all", "tail", "sliding")}
        assert ev["passkey"]["lengths"] == [32] and ev["passkey"]["depths"] == [0.5]
        assert np.shape(ev["passkey"]["gain"]) == (1, 1)
        assert np.shape(ev["passkey"]["gain_trials"]) == np.shape(ev["passkey"]["exact_trials"]) == (1, 1, 2)
        assert all(len(v) == 1 for v in ev["entropy"].values())  # one layer
        # 3 steps from a near-uniform start: still near 8 bits per byte, and finite
        assert all(6.0 < v["all"] < 8.5 for v in ev["bpb"].values())
    assert data["eval_config"]["windows"] == 8 and data["eval_config"]["blocks"] == 4
    ckpts = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.suffix == ".pt")
    assert len(ckpts) == 2
    # each job's record is kept beside its checkpoint, for a rerun to reuse
    records = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.suffix == ".json")
    assert [r.split(".eval-")[0] + ".pt" for r in records] == ckpts
    user_ckpt = next(p for p in (tmp_path / "ck").iterdir() if "LongBaseRotary" in p.name and p.suffix == ".pt")
    model, _ = load_checkpoint(user_ckpt)
    assert type(model.scheme) is lab_user_scheme.LongBaseRotary


@pytest.mark.slow
def test_cli_train_then_eval_round_trip(tmp_path):
    ck, t_out, e_out = tmp_path / "a.pt", tmp_path / "train.json", tmp_path / "eval.json"
    done = _lab("train", "--scheme", "alibi", "--steps", "5", *TINY_FLAGS, *EVAL_FLAGS,
                "--checkpoint", str(ck), "--out", str(t_out))
    assert "alibi seed 0: final training loss" in done.stdout
    _lab("eval", "--checkpoint", str(ck), "--out", str(e_out), *EVAL_FLAGS)
    t, e = load_result(t_out)["data"], load_result(e_out)["data"]
    assert e["config"] == t["config"] and e["log"] == t["log"]
    assert t["config"]["scheme"] == "alibi" and t["config"]["steps"] == 5
    # the same weights, the same evaluation, the same thread count: the same numbers
    assert e["eval"] == t["eval"]
    # and the saved checkpoint holds the trained weights
    model, ckpt = load_checkpoint(ck)
    assert ckpt["step"] == 5 and isinstance(model.scheme, ALiBi)


def test_training_projects_constrained_scheme_parameters():
    """After each optimiser step the trainer calls project_() (Kerple's in-place clamp)."""
    from companion import KerpleBias
    from companion.lab.train import project_parameters
    model = TinyDecoder(256, 16, 2, 1, scheme=KerpleBias(2, form="power"))
    with torch.no_grad():
        model.scheme.r1.fill_(-1.0)
        model.scheme.r2.fill_(5.0)
    project_parameters(model)
    assert bool((model.scheme.r1 > 0).all()) and bool((model.scheme.r2 <= 2).all())


def test_trainfree_lab_settings_keep_positions_in_the_trained_range():
    from companion.lab.trainfree_lab import LAB_TRAINFREE, lab_settings
    from companion.trainfree import ReRoPE, SelfExtend, max_relative_position
    L = 128
    for W in (128, 256, 512, 2048):
        for name in LAB_TRAINFREE:
            kw = lab_settings(name, L, W)
            if name in ("rerope", "leaky_rerope"):
                top = max_relative_position(ReRoPE(kw["window"], kw.get("leak")), W)
            elif name == "self_extend":
                top = max_relative_position(SelfExtend(kw["window"], kw["group"]), W)
                if kw["group"] > 1:  # the smallest group that fits
                    assert max_relative_position(SelfExtend(kw["window"], kw["group"] - 1), W) > L - 1
            else:
                top = kw["n_sink"] + kw["window"] + kw["chunk"] - 1
            assert top <= L - 1, (name, W, kw, top)
    assert lab_settings("self_extend", L, 2048)["group"] == 32
    with pytest.raises(ValueError, match="name must be one of"):
        lab_settings("yarn", L, 256)


def _tiny_rope_model(seed=0):
    torch.manual_seed(seed)
    return TinyDecoder(256, 16, 2, 2, scheme=build_scheme("rope", d_model=16, n_heads=2, max_len=256,
                                                          train_len=32)).eval()


def test_lab_logits_stream_is_what_lab_stream_nll_scores():
    from companion.lab.trainfree_lab import lab_logits, lab_stream_nll
    model = _tiny_rope_model()
    rows = torch.randint(0, 256, (3, 50), generator=torch.Generator().manual_seed(1))
    kw = {"n_sink": 2, "window": 12, "chunk": 5, "rerotate": True}
    logits = lab_logits("sinks", **kw)(model, rows)
    assert logits.shape == (3, 50, 256) and logits.dtype == torch.float32
    # lab_stream_nll scores each chunk as it comes; scored the same way, chunk by chunk, these
    # logits give its numbers bit for bit on every CPU. (One cross-entropy over all 49 positions
    # can differ by a few ulps: the softmax kernel vectorises over the positions, so another
    # length rounds otherwise, as the AVX2 kernels do.)
    ce = torch.nn.functional.cross_entropy
    nll = torch.cat([ce(logits[:, s:min(s + 5, 49)].transpose(1, 2), rows[:, s + 1:min(s + 5, 49) + 1],
                        reduction="none") for s in range(0, 49, 5)], dim=1)
    assert torch.equal(nll, lab_stream_nll(model, rows, **kw))


def test_lab_logits_wide_windows_are_the_plain_model():
    from companion.lab.trainfree_lab import lab_logits
    model = _tiny_rope_model().double()
    rows = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    plain = model(rows).double()
    # nothing evicted, no far pair regrouped: every method is the plain model. The model runs in
    # float64 (its sums of 40 terms of size O(1) differ from the plain pass by far less than
    # 1e-12) and lab_logits rounds the logits to float32 (a relative error of at most 2^-24)
    for method, kw in (("sinks", {"n_sink": 4, "window": 64, "chunk": 7}), ("rerope", {"window": 64}),
                       ("self_extend", {"window": 64, "group": 3})):
        got = lab_logits(method, **kw)(model, rows).double()
        assert bool(((got - plain).abs() <= 2**-24 * plain.abs() + 1e-12).all()), method
    with pytest.raises(ValueError, match="unknown keys"):
        lab_logits("sinks", group=2)


def test_passkey_retrieval_forward_replaces_the_models_own():
    from companion.lab.evaluate import passkey_retrieval
    model = _tiny_rope_model()
    data = np.random.default_rng(0).integers(32, 127, 4000).astype(np.uint8)
    a = passkey_retrieval(model, data, [40], [0.0, 1.0], trials=3, seed=5)
    b = passkey_retrieval(model, data, [40], [0.0, 1.0], trials=3, seed=5, forward=lambda rows: model(rows))
    assert a == b
    zero = passkey_retrieval(model, data, [40], [0.0], trials=3, seed=5,
                             forward=lambda rows: torch.zeros(*rows.shape, 256))
    assert zero["gain_trials"] == [[[0.0, 0.0, 0.0]]]  # a forward that ignores its input gains nothing
    with pytest.raises(TypeError, match="forward must be None or a function"):
        passkey_retrieval(model, data, [40], [0.0], trials=1, forward=3)


# ---------------------------------------------------------------------------------------
# --quick: a smoke run's preset (issue 31)


class _Stop(Exception):
    pass


def _quick_calls(monkeypatch, argv):
    """Run the lab's main up to its work and return what it would run with, and what it printed."""
    from companion.lab import __main__ as lab_main

    seen = {}

    def stop(name):
        def record(*args, **kwargs):
            seen[name] = (args, kwargs)
            raise _Stop

        return record

    monkeypatch.setattr(lab_main, "run_sweep", stop("run_sweep"))
    monkeypatch.setattr(lab_main, "train_missing", lambda configs, paths, workers=2: seen.update(train=(configs, paths)))
    monkeypatch.setattr(lab_main, "run_extension", stop("run_extension"))
    with pytest.raises(_Stop):
        lab_main.main(argv)
    return seen


def test_quick_sweep_sets_its_preset(monkeypatch, capsys):
    from companion.lab.__main__ import QUICK_SWEEP

    (configs, ev), kw = _quick_calls(monkeypatch, ["sweep", "--quick"])["run_sweep"]
    assert configs == [TrainConfig(scheme=s, seed=0, steps=100, warmup=10) for s in ("rope", "alibi")]
    assert ev == EvalConfig(**{k: v for k, v in QUICK_SWEEP.items() if k in asdict(EvalConfig())})
    assert kw["checkpoint_dir"] == "runs/lab-quick" and kw["out"] is None
    # smaller than the real run in every count it sets
    real = EvalConfig()
    assert configs[0].steps < TrainConfig().steps and ev.windows < real.windows and ev.sliding_tokens < real.sliding_tokens
    assert ev.passkey_trials < real.passkey_trials and max(ev.multiples) < max(real.multiples)
    printed = capsys.readouterr().out
    assert printed.startswith("SMOKE RUN (--quick): small settings to try the command, not a measurement.\n")
    assert "--quick set --schemes rope alibi --seeds 0 --steps 100 --warmup 10 --checkpoint-dir runs/lab-quick" in printed
    # explicit flags win over the preset, before or after --quick
    (configs, ev), _ = _quick_calls(monkeypatch, ["sweep", "--schemes", "nope", "--quick", "--steps", "7",
                                                  "--windows", "16"])["run_sweep"]
    assert [(c.scheme, c.seed, c.steps, c.warmup) for c in configs] == [("nope", 0, 7, 10)]
    assert ev.windows == 16 and ev.passkey_trials == 4
    assert "kept from the command line: --schemes nope --steps 7 --windows 16" in capsys.readouterr().out


def test_quick_extend_sets_its_preset(monkeypatch, tmp_path):
    from companion.lab.__main__ import QUICK_EXTEND
    from companion.lab.extend import ExtendConfig

    seen = _quick_calls(monkeypatch, ["extend", "--quick", "--out", str(tmp_path / "e.csv")])
    configs, paths = seen["train"]
    assert configs == [TrainConfig(scheme="rope", seed=0, steps=100, warmup=10)]
    assert [Path(p).parent for p in paths] == [Path("runs/lab-quick")]
    (ckpts, methods, factors, ft_steps, ev), kw = seen["run_extension"]
    assert (list(ckpts), methods, factors, ft_steps) == (paths, ["none", "pi", "yarn"], [2.0], [0, 10])
    assert ev == ExtendConfig(**{k: v for k, v in QUICK_EXTEND.items() if k in asdict(ExtendConfig())})
    assert kw["cache_dir"] == str(Path("runs/lab-quick") / "extend")


def test_quick_results_are_marked(tmp_path, capsys):
    """A --quick sweep and extension (tiny settings given explicitly) record "quick": true."""
    from companion.lab.__main__ import main
    from companion.utils import load_csv

    ck, out = tmp_path / "ck", tmp_path / "s.json"
    tiny = [*TINY_FLAGS, "--steps", "3", "--workers", "1", "--checkpoint-dir", str(ck)]
    assert main(["sweep", "--quick", "--schemes", "nope", *tiny, *EVAL_FLAGS, "--out", str(out)]) == 0
    payload = load_result(out)
    assert payload["data"]["quick"] is True and "--quick" in payload["provenance"]["command"]
    assert [r["config"]["scheme"] for r in payload["data"]["runs"]] == ["nope"]
    printed = capsys.readouterr().out
    assert f'SMOKE RUN (--quick): small settings to try the command, not a measurement: {out} records "quick": true' \
        in printed and printed.rstrip().splitlines()[-1].split()[:2] == ["nope", "1"]  # the table's row
    csv, js = tmp_path / "e.csv", tmp_path / "e.json"
    assert main(["extend", "--quick", *tiny, "--methods", "none", "pi", "--finetune-steps", "0", "--multiples", "1", "2",
                 "--windows", "8", "--blocks", "4", "--sliding-tokens", "64", "--out", str(csv), "--json", str(js)]) == 0
    prov, rows = load_csv(csv)
    assert prov["quick"] is True and {r["method"] for r in rows} == {"none", "pi"}
    # the table at the end: a line per job, a column per length, each the stored mean
    table = capsys.readouterr().out.rstrip().splitlines()
    assert table[-3].split() == ["method", "s", "fine-tune", "32", "64"]
    tails = {(r["method"], r["length"]): float(r["value"]) for r in rows if r["metric"] == "bpb_tail"}
    assert table[-2].split() == ["none", "1", "0", f"{tails['none', '32']:.3f}", f"{tails['none', '64']:.3f}"]
    assert table[-1].split() == ["pi", "2", "0", f"{tails['pi', '32']:.3f}", f"{tails['pi', '64']:.3f}"]
    assert load_result(js)["data"]["quick"] is True
    # a real run records no such key
    assert main(["extend", *tiny, "--methods", "none", "--finetune-steps", "0", "--multiples", "1", "2",
                 "--windows", "8", "--blocks", "4", "--sliding-tokens", "64", "--passkey-trials", "2",
                 "--out", str(csv)]) == 0
    assert "quick" not in load_csv(csv)[0]


def test_windowed_layers_equal_a_banded_mask():
    from companion import ALiBi, RotaryEmbedding
    n, W = 70, 9
    i = torch.arange(n)
    band = ((i[None, :] > i[:, None] - W) & (i[None, :] <= i[:, None]))[None, None]   # query i sees j in (i-W, i]
    x = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(3))
    for scheme in (RotaryEmbedding(8), ALiBi(2), None):
        torch.manual_seed(0)
        windowed = TinyDecoder(256, 16, 2, 2, scheme=scheme, window=W).double().eval()
        torch.manual_seed(0)
        plain = TinyDecoder(256, 16, 2, 2, scheme=scheme).double().eval()
        with torch.no_grad():
            got, want = windowed(x), plain(x, attn_mask=band)
        # the same float64 function of the same weights by two paths: sums of at most 70 terms
        assert (got - want).abs().max() < 1e-12, type(scheme).__name__
        assert windowed.window_layers == (0, 1)
    torch.manual_seed(0)
    local = TinyDecoder(256, 16, 2, 2, scheme=RotaryEmbedding(8), window=W, window_layers=[0]).eval()
    assert [b.attn.window for b in local.blocks] == [W, None]
    with pytest.raises(ValueError, match="window_layers needs a window"):
        TinyDecoder(256, 16, 2, 2, window_layers=[0])
    with pytest.raises(ValueError, match="window"):
        TinyDecoder(256, 16, 2, 2, window=0)
    with pytest.raises(IndexError, match="window_layers entries must lie in"):
        TinyDecoder(256, 16, 2, 2, window=4, window_layers=[2])


def test_rope_window_nope_is_local_rope_and_global_nope():
    from companion.lab import build_model
    from companion.lab.schemes import window_for
    assert window_for("rope-window-nope", 4, 128) == (64, (0, 2)) and window_for("rope", 2, 128) == (None, ())
    model = build_model(TrainConfig(scheme="rope-window-nope", n_layers=2, steps=10))
    assert [(type(b.attn.scheme).__name__, b.attn.window) for b in model.blocks] == [("RotaryEmbedding", 64),
                                                                                     ("NoPE", None)]
