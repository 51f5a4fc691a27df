"""Bad input to the lab's core API gives a clear error naming the argument.

EvalConfig and TrainConfig check their fields where they are made; the evaluations of
:mod:`companion.lab.evaluate` check the model, the data and every count; ``build_scheme``
the model's shape; ``lr_at`` the step; ``load_checkpoint`` and ``run_trainfree`` the files;
``lab_forward`` the token ids; the command line an ``--out`` under a file before any work.
Valid calls keep their results (checked against independent computations here).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

import companion.lab.__main__ as lab_main
import companion.lab.sweep as sweep_mod
from companion.attention import NoPE
from companion.lab import trainfree_lab as tl
from companion.lab.evaluate import attention_entropy, bits_per_byte, passkey_retrieval, sliding_bits_per_byte
from companion.lab.schemes import build_scheme
from companion.lab.sweep import EvalConfig, check_eval_config, evaluate_model
from companion.lab.train import TrainConfig, build_model, load_checkpoint, lr_at
from companion.model import TinyDecoder
from companion.rope import RotaryEmbedding

REPO = Path(__file__).resolve().parents[1]
NAN = float("nan")
TINY = dict(d_model=8, n_heads=2, n_layers=1, seq_len=16, max_len=64, steps=1, warmup=0)


def _model(scheme=None) -> TinyDecoder:
    torch.manual_seed(0)
    return TinyDecoder(256, 8, 2, 1, scheme=RotaryEmbedding(4) if scheme is None else scheme).eval()


def _data(n: int = 500) -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, n).astype(np.uint8)


def _refuse(*args, **kwargs):
    raise AssertionError("work started before the arguments were checked")


# ---------------------------------------------------------------------------------------
# EvalConfig


@pytest.mark.parametrize("field,value,error", [
    ("multiples", [0], ValueError), ("multiples", [-1], ValueError), ("multiples", [1.5], TypeError),
    ("multiples", "1", TypeError), ("multiples", [], ValueError), ("multiples", None, TypeError),
    ("multiples", [True], TypeError),
    ("windows", 0, ValueError), ("windows", -2, ValueError), ("windows", 1.5, TypeError),
    ("blocks", 0, ValueError), ("blocks", 3, ValueError), ("blocks", 1.5, TypeError),
    ("sliding_tokens", 0, ValueError), ("sliding_tokens", -1, ValueError),
    ("passkey_multiples", [0], ValueError), ("passkey_multiples", [], ValueError),
    ("passkey_multiples", "1", TypeError),
    ("passkey_depths", [1.5], ValueError), ("passkey_depths", [-0.5], ValueError),
    ("passkey_depths", [NAN], ValueError),
    ("passkey_depths", "0.5", TypeError), ("passkey_depths", [], ValueError), ("passkey_depths", ["0.5"], TypeError),
    ("passkey_trials", 0, ValueError), ("passkey_trials", 1.5, TypeError),
    ("entropy_windows", 0, ValueError), ("entropy_windows", -1, ValueError),
])
def test_eval_config_checks_each_field_where_it_is_made(field, value, error):
    with pytest.raises(error, match=field):
        EvalConfig(**{field: value})


def test_eval_config_blocks_rules_name_both_fields():
    with pytest.raises(ValueError, match=r"blocks \(3\) must divide windows \(2048\)"):
        EvalConfig(blocks=3)
    with pytest.raises(ValueError, match=r"sliding_tokens \(8\) must be at least blocks \(256\)"):
        EvalConfig(sliding_tokens=8)


def test_eval_config_defaults_and_valid_values_are_unchanged():
    ev = EvalConfig()
    assert asdict(ev) == {"multiples": [1, 2, 4, 8, 16], "windows": 2048, "blocks": 256, "sliding_tokens": 1 << 17,
                          "passkey_multiples": [1, 2, 4, 8, 16], "passkey_depths": [0.0, 0.5, 1.0],
                          "passkey_trials": 32, "entropy_windows": 8}
    # the edges of the rules are valid: depths 0 and 1 (ints too), blocks = windows = sliding_tokens
    edge = EvalConfig(multiples=(1,), windows=4, blocks=4, sliding_tokens=4, passkey_depths=[0, 1], passkey_trials=1,
                      entropy_windows=1)
    assert edge.passkey_depths == [0, 1] and edge.multiples == (1,)
    # the reduced protocol chapter 8 builds
    EvalConfig(multiples=[1, 8], windows=256, blocks=8, sliding_tokens=1 << 10, passkey_multiples=[1],
               passkey_depths=[0.5], passkey_trials=2, entropy_windows=1)


def test_stored_configs_still_load():
    from companion.lab.results import load_sweep
    from companion.utils import load_result

    # chapter 8's sweep (the current protocol, in parts) and chapter 11's baselines (the older one)
    for path in ("chapters/data/08_sweep", "chapters/data/11_baselines.json"):
        sw = load_sweep(REPO / path)
        ev = {k: v for k, v in sw.eval_config.items() if k in {f for f in asdict(EvalConfig())}}
        check_eval_config(EvalConfig(**ev))
        for run in sw.data["runs"]:
            assert asdict(TrainConfig.from_dict(run["config"])) == run["config"]


def test_check_eval_config_catches_a_field_changed_after_construction():
    ev = EvalConfig()
    ev.multiples = [0]
    with pytest.raises(ValueError, match="multiples must be >= 1, got 0"):
        check_eval_config(ev)
    with pytest.raises(TypeError, match="cfg must be a TrainConfig"):
        check_eval_config(EvalConfig(), {"seq_len": 16})


def test_evaluate_model_checks_the_configs_before_loading_the_corpus(monkeypatch):
    monkeypatch.setattr(sweep_mod, "load_corpus", _refuse)
    cfg = TrainConfig(**TINY)
    ev = EvalConfig(multiples=[1], windows=4, blocks=2, sliding_tokens=4, passkey_multiples=[1])
    ev.passkey_depths = [2.0]
    with pytest.raises(ValueError, match="passkey_depths must lie in"):
        evaluate_model(_model(), cfg, ev)
    with pytest.raises(TypeError, match="cfg must be a TrainConfig"):
        evaluate_model(_model(), asdict(cfg), EvalConfig())
    with pytest.raises(TypeError, match="ev must be an EvalConfig"):
        evaluate_model(_model(), cfg, asdict(ev))


# ---------------------------------------------------------------------------------------
# TrainConfig, build_scheme, lr_at


@pytest.mark.parametrize("scheme,error", [("bogus", ValueError), ("ROPE", ValueError), ("", ValueError),
                                          (5, TypeError), (None, TypeError), ("a b:C", ValueError),
                                          ("mod:", ValueError), (":Cls", ValueError), ("a:b:c", ValueError)])
def test_train_config_refuses_an_unknown_scheme(scheme, error):
    with pytest.raises(error, match="scheme"):
        TrainConfig(scheme=scheme)


def test_train_config_scheme_hint_and_valid_names():
    with pytest.raises(ValueError, match="did you mean 'rope'"):
        TrainConfig(scheme="ROPE")
    # a module:Class spec is checked by its form only (imported when the model is built)
    assert TrainConfig(scheme="no_such_pkg.enc:MyScheme").scheme == "no_such_pkg.enc:MyScheme"
    assert TrainConfig(scheme="lab_user_scheme:LongBaseRotary").scheme == "lab_user_scheme:LongBaseRotary"
    for name in ("rope", "rope-nope", "p-rope", "kerple-log"):
        assert TrainConfig(scheme=name).scheme == name


KW = dict(d_model=16, n_heads=2, max_len=64, train_len=16)


@pytest.mark.parametrize("over,error,match", [
    (dict(n_heads=0), ValueError, "n_heads must be >= 1, got 0"),
    (dict(d_model=0), ValueError, "d_model must be >= 1, got 0"),
    (dict(train_len="16"), TypeError, "train_len must be an int"),
    (dict(max_len=0), ValueError, "max_len must be >= 1, got 0"),
    (dict(max_len=True), TypeError, "max_len must be an int"),
    (dict(d_model=15), ValueError, r"d_model \(15\) must be a multiple of n_heads \(2\)"),
])
def test_build_scheme_checks_the_shape(over, error, match):
    with pytest.raises(error, match=match):
        build_scheme("rope", **{**KW, **over})


def test_build_scheme_valid_shape_is_unchanged():
    rope = build_scheme("rope", **KW)
    assert isinstance(rope, RotaryEmbedding) and rope.head_dim == 8
    assert build_scheme("companion:ALiBi", **KW).scheme_heads() == 2


@pytest.mark.parametrize("step,error", [(-1, ValueError), ("3", TypeError), (1.5, TypeError), (True, TypeError)])
def test_lr_at_checks_the_step(step, error):
    with pytest.raises(error, match="step"):
        lr_at(step, TrainConfig(steps=10, warmup=2))


def test_lr_at_checks_the_config_and_keeps_its_values():
    with pytest.raises(TypeError, match="cfg must be a TrainConfig, got dict"):
        lr_at(0, {"warmup": 1})
    cfg = TrainConfig(steps=11, warmup=2, lr=0.01, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.005)
    assert lr_at(1, cfg) == pytest.approx(0.01)
    # cosine from lr at step 2 to min_lr_ratio * lr at step 10 (the last), half way at step 6
    assert lr_at(6, cfg) == pytest.approx(0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(10, cfg) == pytest.approx(0.001)
    assert lr_at(50, cfg) == pytest.approx(0.001)  # past the end: the floor


# ---------------------------------------------------------------------------------------
# load_checkpoint, run_trainfree


def _checkpoint(path: Path) -> Path:
    cfg = TrainConfig(**TINY)
    torch.save({"config": asdict(cfg), "step": 1, "model": build_model(cfg).state_dict(), "optimizer": {},
                "log": [], "info": {}, "seconds": 0.0}, path)
    return path


def test_load_checkpoint_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.pt does not exist"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        load_checkpoint(tmp_path)
    with pytest.raises(TypeError, match="path must be a path"):
        load_checkpoint(None)
    (tmp_path / "text.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="text.pt' is not a checkpoint written by companion.lab.train"):
        load_checkpoint(tmp_path / "text.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"other.pt' is not a checkpoint .*expected a dict with 'config' and 'model', "
                                         r"got \['weights'\]"):
        load_checkpoint(tmp_path / "other.pt")
    ckpt = torch.load(_checkpoint(tmp_path / "good.pt"), weights_only=True)
    ckpt["model"] = {"tok.weight": torch.zeros(3, 3)}
    torch.save(ckpt, tmp_path / "wrong.pt")
    with pytest.raises(ValueError, match="wrong.pt' is not a checkpoint .*weights do not fit"):
        load_checkpoint(tmp_path / "wrong.pt")
    ckpt["config"] = {**ckpt["config"], "scheme": "bogus"}
    torch.save(ckpt, tmp_path / "badcfg.pt")
    with pytest.raises(ValueError, match="badcfg.pt' is not a checkpoint .*config is invalid .*scheme"):
        load_checkpoint(tmp_path / "badcfg.pt")


def test_load_checkpoint_of_a_valid_file_gives_the_saved_weights(tmp_path):
    path = _checkpoint(tmp_path / "good.pt")
    model, ckpt = load_checkpoint(str(path))
    saved = torch.load(path, weights_only=True)["model"]
    assert not model.training and ckpt["step"] == 1
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved[name]), name


def test_run_trainfree_checks_the_checkpoint_files_before_loading(monkeypatch, tmp_path):
    monkeypatch.setattr(tl, "load_corpus", _refuse)
    monkeypatch.setattr(tl, "load_checkpoint", _refuse)
    good = str(_checkpoint(tmp_path / "good.pt"))
    with pytest.raises(FileNotFoundError, match=r"checkpoints\[1\] .*missing.pt does not exist"):
        tl.run_trainfree([good, str(tmp_path / "missing.pt")], [1])
    with pytest.raises(IsADirectoryError, match=r"checkpoints\[0\]"):
        tl.run_trainfree([tmp_path], [1])
    with pytest.raises(AssertionError, match="work started"):  # valid: it reaches the corpus
        tl.run_trainfree([good], [1])


# ---------------------------------------------------------------------------------------
# the evaluations

EV = dict(windows_per_length=4, blocks=2)


@pytest.mark.parametrize("args,kwargs,error,match", [
    (("model", _data(), [8]), EV, TypeError, "model must be a torch.nn.Module"),
    ((None, _data(), [8]), EV, TypeError, "model must be"),
    ((_model(), _data().tolist(), [8]), EV, TypeError, "data must be a 1-D numpy array"),
    ((_model(), torch.from_numpy(_data()), [8]), EV, TypeError, "data must be a 1-D numpy array"),
    ((_model(), _data().astype(np.float32), [8]), EV, TypeError, "data must hold integer byte values"),
    ((_model(), _data().astype(bool), [8]), EV, TypeError, "data must hold integer"),
    ((_model(), _data().reshape(20, 25), [8]), EV, ValueError, r"data must be 1-D .*\(20, 25\)"),
    ((_model(), _data().astype(np.int64) + 100, [8]), EV, ValueError, r"data must hold byte values in \[0, 256\)"),
    ((_model(), _data(), 16), EV, TypeError, "lengths must be a list of ints"),
    ((_model(), _data(), "16"), EV, TypeError, "lengths must be a list of ints"),
    ((_model(), _data(), [8]), dict(EV, tokens_per_batch=0), ValueError, "tokens_per_batch must be >= 1, got 0"),
    ((_model(), _data(), [8]), dict(EV, tokens_per_batch=1.5), TypeError, "tokens_per_batch must be an int"),
])
def test_bits_per_byte_checks_its_arguments(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        bits_per_byte(*args, **kwargs)


def test_bits_per_byte_valid_inputs_keep_their_numbers():
    model, data = _model(), _data()
    got = bits_per_byte(model, data, [8, 16], **EV)
    # an independent loop over the windows that end at the same bytes
    ends = (16 + np.linspace(0, data.size - 1 - 16, 4).round()).astype(np.int64)
    for w in (8, 16):
        rows = torch.from_numpy(np.stack([data[e - w:e + 1] for e in ends]).astype(np.int64))
        with torch.no_grad():
            logp = torch.log_softmax(model(rows[:, :-1]).double(), -1)
        bits = -logp.gather(-1, rows[:, 1:, None])[..., 0] / math.log(2)
        assert got[w]["all"] == pytest.approx(float(bits.mean()), abs=1e-4)
        assert got[w]["tail"] == pytest.approx(float(bits[:, -min(64, w):].mean()), abs=1e-4)
    # other integer dtypes of the same bytes, a numpy int length, a tuple: the same numbers
    assert bits_per_byte(model, data.astype(np.int64), (np.int64(8), 16), **EV) == got
    one_row = bits_per_byte(model, data, [8, 16], tokens_per_batch=1, **EV)  # one window per batch
    for w in (8, 16):
        assert one_row[w]["all"] == pytest.approx(got[w]["all"], abs=1e-5)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(stride_fraction="0.5"), TypeError, "stride_fraction must be a finite number"),
    (dict(stride_fraction=NAN), ValueError, "stride_fraction"),
    (dict(stride_fraction=1.5), ValueError, r"stride_fraction must lie in \(0, 1\]"),
    (dict(stride_fraction=0.0), ValueError, "stride_fraction"),
    (dict(scored_tokens=1, blocks=2), ValueError, r"scored_tokens \(1\) must be at least blocks \(2\)"),
    (dict(tokens_per_batch=0), ValueError, "tokens_per_batch must be >= 1"),
])
def test_sliding_bits_per_byte_checks_its_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        sliding_bits_per_byte(_model(), _data(), [8], **{"scored_tokens": 16, "blocks": 2, **kwargs})
    with pytest.raises(TypeError, match="model must be"):
        sliding_bits_per_byte("model", _data(), [8], scored_tokens=16, blocks=2)


def test_sliding_bits_per_byte_edge_is_valid():
    # scored_tokens = blocks: one byte per stretch, each the last prediction of its window
    got = sliding_bits_per_byte(_model(), _data(), [8], scored_tokens=2, blocks=2, stride_fraction=0.125)
    assert len(got[8]["sliding_blocks"]) == 2
    assert got[8]["sliding"] == pytest.approx(float(np.mean(got[8]["sliding_blocks"])))


@pytest.mark.parametrize("depths,kwargs,error,match", [
    ([1.5], {}, ValueError, r"depths must lie in \[0, 1\]"),
    ([-0.5], {}, ValueError, "depths must be a finite number >= 0"),
    ([NAN], {}, ValueError, "depths must be a finite number"),
    ("0.5", {}, TypeError, "depths must be a non-empty list"),
    ([], {}, ValueError, "depths must be a non-empty list"),
    (0.5, {}, TypeError, "depths must be a non-empty list"),
    ([0.5], dict(seed=-1), ValueError, "seed must be >= 0, got -1"),
    ([0.5], dict(seed=1.5), TypeError, "seed must be an int"),
    ([0.5], dict(tokens_per_batch=0), ValueError, "tokens_per_batch must be >= 1"),
])
def test_passkey_retrieval_checks_its_arguments(depths, kwargs, error, match):
    with pytest.raises(error, match=match):
        passkey_retrieval(_model(), _data(), [32], depths, **{"trials": 2, **kwargs})
    with pytest.raises(ValueError, match="lengths must be at least 13"):
        passkey_retrieval(_model(), _data(), [32, 5], [0.5], trials=2)


def test_passkey_retrieval_valid_depths_keep_their_numbers():
    model, data = _model(), _data()
    got = passkey_retrieval(model, data, [32], [0.0, 1.0], trials=2)
    # int depths and a numpy array of them are the same positions: the same result
    assert passkey_retrieval(model, data, [32], [0, 1], trials=2) == got
    assert passkey_retrieval(model, data, [32], np.array([0.0, 1.0]), trials=2) == got
    assert [len(got["gain"]), len(got["gain"][0]), len(got["gain_trials"][0][0])] == [1, 2, 2]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(windows_per_length=0), ValueError, "windows_per_length must be >= 1, got 0"),
    (dict(tail=0), ValueError, "tail must be >= 1, got 0"),
    (dict(tail=-1), ValueError, "tail must be >= 1, got -1"),
    (dict(tail=1.5), TypeError, "tail must be an int"),
    (dict(lengths=[0]), ValueError, "lengths must be >= 1, got 0"),
    (dict(lengths=[]), ValueError, "lengths must hold at least one length"),
    (dict(data=[1, 2, 3]), TypeError, "data must be a 1-D numpy array"),
    (dict(model=torch.nn.Linear(2, 2)), TypeError, "model must be a companion.model.TinyDecoder"),
])
def test_attention_entropy_checks_its_arguments(kwargs, error, match):
    args = {"model": _model(NoPE()), "data": _data(), "lengths": [16], **kwargs}
    with pytest.raises(error, match=match):
        attention_entropy(args.pop("model"), args.pop("data"), args.pop("lengths"), **args)


def test_attention_entropy_of_uniform_attention_is_unchanged():
    model = _model(NoPE())
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q_proj.weight.zero_()
            block.attn.k_proj.weight.zero_()
    got = attention_entropy(model, _data(), [16], windows_per_length=2, tail=4)
    assert got == {16: [pytest.approx(float(np.mean([math.log2(i + 1) for i in range(12, 16)])), abs=1e-5)]}


# ---------------------------------------------------------------------------------------
# lab_forward


def test_lab_forward_checks_the_token_ids():
    model, idx = _model(), torch.randint(0, 256, (2, 6))
    with pytest.raises(TypeError, match="idx must hold integer token ids .*got dtype torch.float32"):
        tl.lab_forward(model, idx.float())
    with pytest.raises(TypeError, match="idx must hold integer token ids"):
        tl.lab_forward(model, idx.bool())
    with pytest.raises(IndexError, match=r"idx must hold token ids in \[0, 256\) .*got 256"):
        tl.lab_forward(model, torch.full((1, 4), 256))
    with pytest.raises(IndexError, match=r"idx must hold token ids in \[0, 256\) .*got -1"):
        tl.lab_forward(model, torch.full((1, 4), -1))
    with pytest.raises(IndexError, match="idx must hold token ids"):
        tl.lab_stream_nll(model, torch.full((1, 4), 300))
    with pytest.raises(TypeError, match="idx must be a torch.Tensor"):
        tl.lab_forward(model, [[1, 2]])


def test_lab_forward_accepts_every_integer_dtype_with_the_same_logits():
    model, idx = _model(), torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(idx)
    assert torch.allclose(tl.lab_forward(model, idx), ref, atol=1e-5)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        assert torch.equal(tl.lab_forward(model, idx.to(dtype)), tl.lab_forward(model, idx))
    assert tl.lab_forward(model, idx[:, :0]).shape == (2, 0, 256)


# ---------------------------------------------------------------------------------------
# the command line


def _no_work(monkeypatch):
    for name in ("load_corpus", "train", "evaluate_model", "run_sweep", "load_checkpoint", "train_missing"):
        monkeypatch.setattr(lab_main, name, _refuse)


@pytest.mark.parametrize("argv,flag", [
    (["train", "--steps", "1", "--out", "{f}/x.json"], "--out"),
    (["train", "--steps", "1", "--out", "{f}/deeper/x.json"], "--out"),
    (["train", "--steps", "1", "--checkpoint", "{f}/x.pt"], "--checkpoint"),
    (["sweep", "--schemes", "rope", "--out", "{f}/x.json"], "--out"),
    (["sweep", "--schemes", "rope", "--checkpoint-dir", "{f}/ckpts"], "--checkpoint-dir"),
    (["trainfree", "--out", "{f}/x.json"], "--out"),
])
def test_cli_refuses_a_path_under_a_file_before_any_work(monkeypatch, tmp_path, capsys, argv, flag):
    _no_work(monkeypatch)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SystemExit) as exc:
        lab_main.main([a.format(f=afile) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag} must be a path in a folder" in err and "lies under the existing file" in err


@pytest.mark.parametrize("argv,flag", [
    (["train", "--windows", "0"], "--windows"),
    (["train", "--passkey-depths", "1.5"], "--passkey-depths"),
    (["train", "--blocks", "3"], "--blocks"),
    (["eval", "--checkpoint", "{ckpt}", "--multiples", "0"], "--multiples"),
    (["sweep", "--schemes", "rope", "--passkey-trials", "0"], "--passkey-trials"),
    (["train", "--scheme", "ROPE"], "--scheme"),
])
def test_cli_bad_eval_options_are_usage_errors(monkeypatch, tmp_path, capsys, argv, flag):
    _no_work(monkeypatch)
    ckpt = _checkpoint(tmp_path / "c.pt")
    with pytest.raises(SystemExit) as exc:
        lab_main.main([a.format(ckpt=ckpt) for a in argv])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_out_in_a_new_folder_reaches_the_work(monkeypatch, tmp_path):
    _no_work(monkeypatch)
    with pytest.raises(AssertionError, match="work started"):
        lab_main.main(["train", "--steps", "1", "--out", str(tmp_path / "new" / "x.json")])
