"""Tests of ``companion.interactive``: the book's interactive figures.

Every number a figure stores is checked against a formula written here, independently of the
package functions the module calls (RoPE's wavelengths, RoFormer's bound, HuggingFace's scaling
formulas, ALiBi's slope rule, T5's buckets, KERPLE's and FIRE's definitions); the container
(:class:`InteractiveFigure`, :class:`Control`) is checked for its JSON packing, its HTML, and
its errors; every figure's traces and layouts are validated against Plotly's schema.
"""

from __future__ import annotations

import base64
import html as html_lib
import json
import math
import re

import numpy as np
import pytest
import torch

from companion import interactive as I
from companion.interactive import Control, InteractiveFigure

TWO_PI = 2 * math.pi


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def clock():
    return I.rope_clock()


@pytest.fixture(scope="module")
def clock_edges():
    """Small bases, tiny head dims and training lengths below 2 pi: the closed form's corners."""
    return I.rope_clock(bases=(2.0, 10.0, 1e4), head_dims=(2, 8, 64), train_lens=(1, 6, 7, 100, 10**6))


@pytest.fixture(scope="module")
def score():
    return I.score_distance()


@pytest.fixture(scope="module")
def scaling():
    return I.scaling_methods()


@pytest.fixture(scope="module")
def biases():
    return I.position_biases()


@pytest.fixture(scope="module")
def all_figures(clock, score, scaling, biases):
    return {"rope_clock": clock, "score_distance": score, "scaling_methods": scaling, "position_biases": biases}


@pytest.fixture(scope="module")
def all_html(all_figures):
    return {name: fig.html() for name, fig in all_figures.items()}


FIGURE_NAMES = ("rope_clock", "score_distance", "scaling_methods", "position_biases")


# ----------------------------------------------------------------------------- helpers


def as_array(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.array([np.nan if v is None else v for v in np.asarray(values, dtype=object).ravel()],
                    dtype=np.float64).reshape(np.shape(values))


def plain(obj):
    """Tensors and arrays as lists (what JSON would hold before rounding)."""
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    return obj


def round4(v: float) -> float | None:
    """``v`` rounded to 4 significant digits by Python's ``round`` (None for NaN)."""
    if math.isnan(v):
        return None
    if v == 0:
        return v  # keeps the sign of -0.0, as JSON does
    return float(round(v, 3 - math.floor(math.log10(abs(v)))))


def expected_packed(obj):
    """What a state should look like after packing: floats to 4 significant digits."""
    obj = plain(obj)
    if isinstance(obj, dict):
        return {k: expected_packed(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [expected_packed(v) for v in obj]
    if isinstance(obj, float):
        return round4(obj)
    return obj


def resolve(obj, arrays):
    if isinstance(obj, dict):
        if set(obj) == {"@"}:
            return list(arrays[obj["@"]])
        return {k: resolve(v, arrays) for k, v in obj.items()}
    if isinstance(obj, list):
        return [resolve(v, arrays) for v in obj]
    return obj


def refs(obj, out):
    """Every ``{"@": i}`` index in ``obj``."""
    if isinstance(obj, dict):
        if set(obj) == {"@"}:
            out.append(obj["@"])
        else:
            for v in obj.values():
                refs(v, out)
    elif isinstance(obj, list):
        for v in obj:
            refs(v, out)
    return out


def shareable(obj, out):
    """Every numeric list of >= 8 numbers in an (expected-packed) object, as its JSON text."""
    if isinstance(obj, dict):
        for v in obj.values():
            shareable(v, out)
    elif isinstance(obj, list):
        if len(obj) >= 8 and all(v is None or isinstance(v, (int, float)) for v in obj):
            out.append(json.dumps(obj, separators=(",", ":")))
        else:
            for v in obj:
                shareable(v, out)
    return out


def trace(state, name):
    found = [t for t in state["data"] if t.get("name") == name]
    assert len(found) == 1, [t.get("name") for t in state["data"]]
    return found[0]


def state_key(fig, key):
    return dict(zip([c.name for c in fig.controls], key))


def payload_json(page: str) -> str:
    m = re.search(r'<script type="application/json" class="pe-data">(.*?)</script>', page, re.S)
    assert m is not None
    return m.group(1)


# ----------------------------------------------------------------------------- 1. RoPE's clock


def closed_form_count(d: int, b: float, L: int) -> int:
    if L < TWO_PI:
        return 0
    return max(0, min(d // 2, math.floor((d / 2) * math.log(L / TWO_PI, b)) + 1))


@pytest.mark.parametrize("which", ["clock", "clock_edges"])
def test_rope_clock_every_state_matches_closed_form(which, request):
    fig = request.getfixturevalue(which)
    assert len(fig.states) == math.prod(len(c.values) for c in fig.controls)
    for (b, d, L), st in fig.states.items():
        i = np.arange(d // 2, dtype=np.float64)
        wl = TWO_PI * b ** (2 * i / d)
        full, never = st["data"][0], st["data"][1]
        n_full = closed_form_count(d, b, L)
        assert len(full["x"]) == n_full, (b, d, L)
        assert len(full["x"]) + len(never["x"]) == d // 2
        xs = np.concatenate([as_array(full["x"]), as_array(never["x"])])
        ys = np.concatenate([as_array(full["y"]), as_array(never["y"])])
        np.testing.assert_array_equal(xs, i)
        np.testing.assert_allclose(ys, wl, rtol=1e-12)
        assert np.all(as_array(full["y"]) <= L) and np.all(as_array(never["y"]) > L)
        assert f": {n_full} of {d // 2} pairs turn fully within L;" in st["readout"]
        assert f"wavelength is {TWO_PI * b ** ((d - 2) / d):,.0f} positions" in st["readout"]
        assert st["layout"]["shapes"][0]["y0"] == L == st["layout"]["shapes"][0]["y1"]


def test_rope_clock_edges_cover_zero_and_all(clock_edges):
    counts = {closed_form_count(d, b, L) for (b, d, L) in clock_edges.states}
    assert 0 in counts and 32 in counts and 1 in counts


@pytest.mark.parametrize("d,b,L", [(128, 1e4, 4096), (64, 100.0, 2048), (2, 10.0, 7), (8, 2.0, 6), (64, 1e7, 131072)])
def test_rope_clock_count_is_the_critical_dimension(d, b, L):
    from companion.recipe import critical_dimension

    state = I.rope_clock(bases=[b], head_dims=[d], train_lens=[L]).states[(b, d, L)]
    assert len(state["data"][0]["x"]) == closed_form_count(d, b, L) == critical_dimension(d, L, b) // 2


def test_rope_clock_default_and_controls(clock):
    assert clock.default == (1e4, 128, 4096)
    assert [c.kind for c in clock.controls] == ["slider", "slider", "select"]
    assert clock.controls[0].labels == ("100", "10,000", "100,000", "500,000", "1,000,000", "10,000,000")
    assert clock.controls[2].labels == ("2,048", "4,096", "8,192", "32,768", "131,072")


# ----------------------------------------------------------------------------- 2. score vs distance


def expected_similar(r: np.ndarray, d: int, b: float) -> np.ndarray:
    theta = b ** (-2 * np.arange(d // 2) / d)
    return np.cos(np.outer(r, theta)).sum(1) / (d / 2)


def bound_formula(r: np.ndarray, d: int, b: float) -> np.ndarray:
    theta = b ** (-2 * np.arange(d // 2) / d)
    out = []
    for dist in np.asarray(r, dtype=np.float64):
        partial = np.cumsum(np.exp(1j * dist * theta))
        out.append(np.abs(partial).sum() / (d / 2))
    return np.array(out)


def brute_first_negative(d: int, b: float, max_distance: int) -> int | None:
    theta = b ** (-2 * np.arange(d // 2) / d)
    for r in range(1, max_distance + 1, 8192):
        rs = np.arange(r, min(r + 8192, max_distance + 1), dtype=np.float64)
        total = np.cos(rs[:, None] * theta[None, :]).sum(1)
        hit = np.flatnonzero(total < 0)
        if hit.size:
            return int(rs[hit[0]])
    return None


def test_score_distance_distances(score):
    expected = np.unique(np.round(np.geomspace(1, 32768, 240)).astype(np.int64))
    for st in score.states.values():
        for t in st["data"]:
            np.testing.assert_array_equal(as_array(t["x"]), expected)


def test_score_distance_similar_keys_follow_expectation(score):
    deviations = []
    for (b,), st in score.states.items():
        sim = trace(st, "similar keys (mean of 64)")
        r = as_array(sim["x"])
        dev = np.abs(as_array(sim["y"]) - expected_similar(r, 128, b))
        assert dev.max() < 0.1, (b, dev.max())
        deviations.append(dev.max())
    # a Monte-Carlo mean, not the formula itself: the margin is real
    assert min(deviations) > 0


def test_score_distance_unrelated_keys_are_noise(score):
    for (b,), st in score.states.items():
        y = as_array(trace(st, "unrelated keys")["y"])
        assert np.mean(np.abs(y)) < 0.15, b
        assert np.any(y != 0)


def test_score_distance_bound_curve(score):
    for (b,), st in score.states.items():
        bound = trace(st, "RoFormer's bound")
        r = as_array(bound["x"])
        at0 = (128 / 2 + 1) / 2
        np.testing.assert_allclose(as_array(bound["y"]), bound_formula(r, 128, b) / at0, rtol=1e-9)
        monotone = bool(np.all(np.diff(bound_formula(r, 128, b)) <= 1e-12))
        assert ("is monotone" if monotone else "is not monotone") in st["readout"]


@pytest.mark.parametrize("d,b", [(128, 1e4), (64, 500000.0), (2, 10.0), (16, 1.5)])
def test_decay_bound_at_zero_and_against_formula(d, b):
    assert I.decay_bound(np.array([0.0]), d, b)[0] == pytest.approx((d / 2 + 1) / 2, rel=1e-14)
    r = np.array([0.0, 1.0, 7.0, 256.0, 3000.0])
    np.testing.assert_allclose(I.decay_bound(r, d, b), bound_formula(r, d, b), rtol=1e-9)


def test_score_distance_first_negative(score):
    for (b,), st in score.states.items():
        fn = brute_first_negative(128, b, 32768)
        if fn is None:
            assert "similar keys stay above zero up to r = 32,768" in st["readout"], b
            assert not st["layout"]["annotations"]
        else:
            assert f"similar keys first score below zero at r = {fn:,} (expected value)" in st["readout"], b
            assert any(s["x0"] == fn == s["x1"] for s in st["layout"]["shapes"])


def test_score_distance_no_negative_within_range():
    fig = I.score_distance(bases=[1e6], head_dim=16, max_distance=300, points=20, samples=8)
    assert brute_first_negative(16, 1e6, 300) is None
    st = fig.state(base=1e6)
    assert st["readout"].startswith("b = 1,000,000: similar keys stay above zero up to r = 300;")
    assert not st["layout"]["annotations"] and len(st["layout"]["shapes"]) == 1


def test_score_distance_readout_bound_at_256(score):
    for (b,), st in score.states.items():
        value = bound_formula(np.array([256.0]), 128, b)[0] / ((128 / 2 + 1) / 2)
        assert f"the bound falls to {value:.2f} at r = 256" in st["readout"], (b, st["readout"])


def test_score_distance_short_max_distance_builds():
    fig = I.score_distance(bases=[1e4], max_distance=100, points=16, samples=4)
    assert fig.states[(1e4,)]["data"][0]["x"][-1] == 100


# ----------------------------------------------------------------------------- 3. scaling methods


METHOD_NAMES = {"pi": "PI", "ntk": "NTK-aware", "dynamic": "Dynamic NTK (at sL)", "yarn": "YaRN",
                "llama3": "Llama 3 scaling", "longrope": "LongRoPE (searched)"}


def yarn_slowdown(b: float, d: int, L: int, s: float, beta_fast: float = 32, beta_slow: float = 1) -> np.ndarray:
    """HuggingFace's ``_compute_yarn_parameters`` (truncate=True), as theta / theta'."""
    def correction_dim(rotations):
        return d * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(b))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    # theta' = theta / s * (1 - extrapolation) + theta * extrapolation
    return 1 / ((1 - extrapolation) / s + extrapolation)


def llama3_slowdown(b: float, d: int, L: int, s: float, low_ff: float = 1.0, high_ff: float = 4.0) -> np.ndarray:
    """HuggingFace's ``_compute_llama3_parameters``, as theta / theta'."""
    wl = TWO_PI * b ** (2 * np.arange(d // 2) / d)
    out = np.empty_like(wl)
    for k, w in enumerate(wl):
        if w < L / high_ff:
            out[k] = 1.0
        elif w > L / low_ff:
            out[k] = s
        else:
            smooth = (L / w - low_ff) / (high_ff - low_ff)
            out[k] = 1 / ((1 - smooth) / s + smooth)
    return out


def expected_slowdowns(b: float, d: int, L: int, s: float) -> dict[str, tuple[np.ndarray, float]]:
    i = np.arange(d // 2, dtype=np.float64)
    n = s * L
    dynamic_base = b * ((s * n / L) - (s - 1)) ** (d / (d - 2))
    ntk_base = b * s ** (d / (d - 2))
    return {
        "pi": (np.full(d // 2, s), 1.0),
        "ntk": (s ** (2 * i / (d - 2)), 1.0),
        "ntk_from_base": ((ntk_base / b) ** (2 * i / d), 1.0),
        "dynamic": ((dynamic_base / b) ** (2 * i / d), 1.0),
        "yarn": (yarn_slowdown(b, d, L, s), 0.1 * math.log(s) + 1),
        "llama3": (llama3_slowdown(b, d, L, s), 1.0),
    }


def test_model_configs_are_the_published_ones():
    assert I.MODEL_CONFIGS == {
        "Llama 2 7B": (10000.0, 128, 4096),
        "Llama 3.1 8B": (500000.0, 128, 8192),
        "Qwen2 7B": (1000000.0, 128, 32768),
        "SmolLM2 135M": (100000.0, 64, 8192),
    }


def test_scaling_methods_every_state(scaling):
    methods = ("pi", "ntk", "dynamic", "yarn", "llama3")
    assert [c.values for c in scaling.controls] == [tuple(I.MODEL_CONFIGS), methods, (2.0, 4.0, 8.0, 16.0, 32.0)]
    assert len(scaling.states) == 4 * 5 * 5
    for name, (b, d, L) in I.MODEL_CONFIGS.items():
        wl = TWO_PI * b ** (2 * np.arange(d // 2) / d)
        for s in (2.0, 4.0, 8.0, 16.0, 32.0):
            expected = expected_slowdowns(b, d, L, s)
            np.testing.assert_allclose(expected["ntk"][0], expected["ntk_from_base"][0], rtol=1e-12)
            for chosen in methods:
                st = scaling.state(config=name, factor=s, method=chosen)
                assert [t["name"] for t in st["data"]] == [METHOD_NAMES[m] for m in methods]
                for m in methods:
                    t = trace(st, METHOD_NAMES[m])
                    np.testing.assert_allclose(as_array(t["x"]), wl, rtol=1e-12)
                    np.testing.assert_allclose(as_array(t["y"]), expected[m][0], rtol=1e-5,
                                               err_msg=f"{name} s={s} {m}")
                    assert t["line"]["width"] == (3 if m == chosen else 1.2)
                slow, att = expected[chosen]
                kept = int(np.sum(np.abs(slow - 1) <= 0.01))
                full = int(np.sum(np.abs(slow / s - 1) <= 0.01))
                assert f"{kept} of {d // 2} pairs kept, {full} slowed by the full {s:g}x" in st["readout"], st["readout"]
                m = re.search(r"goes from ([\d,]+) to ([\d,]+) positions", st["readout"])
                assert m is not None and m.group(1) == f"{wl[-1]:,.0f}"
                assert float(m.group(2).replace(",", "")) == pytest.approx(wl[-1] * slow[-1], rel=1e-5, abs=0.5)
                assert st["readout"].endswith(f"attention factor {att:.4f}.")
                assert {sh["x0"] for sh in st["layout"]["shapes"]} == {L, s * L}


def test_scaling_methods_counts_are_not_trivial(scaling):
    # the readout's counts vary: kept and fully slowed pairs both occur, and neither is always all
    kept, full = set(), set()
    for st in scaling.states.values():
        m = re.search(r"(\d+) of (\d+) pairs kept, (\d+) slowed", st["readout"])
        kept.add(int(m.group(1)))
        full.add(int(m.group(3)))
    assert len(kept) > 3 and len(full) > 3


def test_scaling_methods_longrope_when_given():
    d, L, s = 64, 8192, 4.0
    long_factor = [1.0 + k / 8 for k in range(d // 2)]
    fig = I.scaling_methods(configs={"SmolLM2 135M": (100000.0, d, L)}, factors=(s,),
                            longrope={"SmolLM2 135M": {s: long_factor}})
    assert fig.controls[1].values[-1] == "longrope"
    st = fig.state(config="SmolLM2 135M", factor=s, method="longrope")
    np.testing.assert_allclose(as_array(trace(st, "LongRoPE (searched)")["y"]), long_factor, rtol=1e-5)
    att = math.sqrt(1 + math.log(s) / math.log(L))
    assert st["readout"].endswith(f"attention factor {att:.4f}.")
    lf = np.array(long_factor)
    kept, full = int(np.sum(np.abs(lf - 1) <= 0.01)), int(np.sum(np.abs(lf / s - 1) <= 0.01))
    assert (kept, full) == (1, 1)  # factors 1 and 4 = s, each once
    assert f"{kept} of {d // 2} pairs kept, {full} slowed by the full 4x" in st["readout"]
    # without searched factors there is no LongRoPE option
    assert "longrope" not in I.scaling_methods(configs={"x": (1e4, 8, 64)}, factors=(2.0,)).controls[2].values


def test_scaling_methods_accepts_head_dim_equal_to_context():
    fig = I.scaling_methods(configs={"tiny": (10000.0, 64, 64)}, factors=(2.0,))
    assert ("tiny", "pi", 2.0) in fig.states


# ----------------------------------------------------------------------------- 4. position biases


def paper_alibi_slopes(n: int) -> list[float]:
    def power_of_two(k):
        return [2 ** (-8 * h / k) for h in range(1, k + 1)]

    if n & (n - 1) == 0:
        return power_of_two(n)
    c = 2 ** int(math.floor(math.log2(n)))
    return power_of_two(c) + [2 ** (-8 * h / (2 * c)) for h in range(1, 2 * c, 2)][: n - c]


def t5_bucket(n: int) -> int:
    if n < 16:
        return n
    return min(31, 16 + int(math.log(n / 16) / math.log(128 / 16) * 16))


POS = np.round(np.linspace(0, 2047, 20)).astype(np.int64)
DIST = np.unique(np.round(np.geomspace(1, 2047, 56)).astype(np.int64))


def learned_schemes(H: int, seed: int = 0):
    """The reference initialisation, drawn in the module's order: Kerple log, power, FIRE."""
    from companion.learned_bias import FIRE, KerpleBias

    torch.manual_seed(seed)
    kl, kp, fire = KerpleBias(H, form="log"), KerpleBias(H, form="power"), FIRE(H)
    return kl, kp, fire


def fire_formula(fire, i: int, r: np.ndarray) -> np.ndarray:
    """FIRE's f(psi(r) / psi(max(L, i))), psi(x) = log(1 + c x), c = 0.1 and L = 512 at init."""
    assert float(fire.c.detach()) == pytest.approx(0.1) and float(fire.threshold.detach()) == 512.0
    x = np.log1p(0.1 * np.asarray(r, dtype=np.float64)) / np.log1p(0.1 * max(512, i))
    with torch.no_grad():
        return fire.mlp(torch.tensor(x, dtype=torch.float32)[:, None]).double().numpy()  # (len, heads)


def test_position_biases_states(biases):
    assert [c.values for c in biases.controls] == [("alibi", "t5", "kerple-log", "kerple-power", "fire"),
                                                   (4, 8, 12, 16), tuple(range(16))]
    assert len(biases.states) == 5 * (4 + 8 + 12 + 16)
    assert biases.default == ("alibi", 8, 0)


def test_position_biases_heatmaps_are_causal(biases):
    future = POS[None, :] > POS[:, None]
    for key, st in biases.states.items():
        heat = st["data"][0]
        assert heat["type"] == "heatmap"
        np.testing.assert_array_equal(as_array(heat["x"]), POS)
        np.testing.assert_array_equal(as_array(heat["y"]), POS)
        z = as_array(heat["z"])
        assert z.shape == (20, 20)
        assert np.all(np.isnan(z[future])), key
        assert not np.any(np.isnan(z[~future])), key


@pytest.mark.parametrize("H", [4, 8, 12, 16])
def test_position_biases_alibi(biases, H):
    slopes = paper_alibi_slopes(H)
    assert len(slopes) == H
    gap = np.clip(POS[:, None] - POS[None, :], 0, None).astype(np.float64)
    for h, m in enumerate(slopes):
        st = biases.state(scheme="alibi", heads=H, head=h)
        curve = st["data"][1]
        np.testing.assert_array_equal(as_array(curve["x"]), DIST)
        np.testing.assert_allclose(as_array(curve["y"]), -m * DIST, rtol=1e-6)
        z = as_array(st["data"][0]["z"])
        causal = POS[:, None] >= POS[None, :]
        np.testing.assert_allclose(z[causal], (-m * gap)[causal], rtol=1e-6)
        assert f"slope m = {m:.6g}:" in st["readout"]
        assert st["readout"].startswith(f"ALiBi, head {h + 1} of {H}:")


def test_alibi_slopes_interleave_for_twelve_heads():
    # 12 heads: the 8 slopes of 8 heads, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (every other slope of 16)
    assert paper_alibi_slopes(12)[8:] == [2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]


def test_position_biases_t5(biases):
    expected_curve = [t5_bucket(int(n)) for n in DIST]
    assert expected_curve[-1] == 31 and expected_curve[0] == 1
    causal = POS[:, None] >= POS[None, :]
    expected_z = np.array([[t5_bucket(int(i - j)) if i >= j else np.nan for j in POS] for i in POS])
    for H in (4, 16):
        for h in (0, H - 1):
            st = biases.state(scheme="t5", heads=H, head=h)
            np.testing.assert_array_equal(as_array(st["data"][1]["y"]), expected_curve)
            z = as_array(st["data"][0]["z"])
            np.testing.assert_array_equal(z[causal], expected_z[causal])


@pytest.mark.parametrize("H", [4, 12])
def test_position_biases_kerple(biases, H):
    kl, kp, _ = learned_schemes(H)
    r1l, r2l = kl.r1.detach().double().numpy(), kl.r2.detach().double().numpy()
    r1p, r2p = kp.r1.detach().double().numpy(), kp.r2.detach().double().numpy()
    gap = np.clip(POS[:, None] - POS[None, :], 0, None).astype(np.float64)
    causal = POS[:, None] >= POS[None, :]
    for h in range(H):
        st = biases.state(scheme="kerple-log", heads=H, head=h)
        np.testing.assert_allclose(as_array(st["data"][1]["y"]), -r1l[h] * np.log(1 + r2l[h] * DIST), rtol=1e-5)
        z = as_array(st["data"][0]["z"])
        np.testing.assert_allclose(z[causal], (-r1l[h] * np.log(1 + r2l[h] * gap))[causal], rtol=1e-5, atol=1e-6)
        assert f"r1 = {r1l[h]:.3f}, r2 = {r2l[h]:.3f}" in st["readout"]
        st = biases.state(scheme="kerple-power", heads=H, head=h)
        np.testing.assert_allclose(as_array(st["data"][1]["y"]), -r1p[h] * DIST ** r2p[h], rtol=1e-5)
        assert f"r1 = {r1p[h]:.3f}, r2 = {r2p[h]:.3f}" in st["readout"]


@pytest.mark.parametrize("H", [4, 16])
def test_position_biases_fire(biases, H):
    _, _, fire = learned_schemes(H)
    low, high = 256, 2048
    for h in range(H):
        st = biases.state(scheme="fire", heads=H, head=h)
        near, far = st["data"][1], st["data"][2]
        assert near["name"] == "query at i = 256" and far["name"] == "query at i = 2,048"
        np.testing.assert_array_equal(as_array(near["x"]), DIST[DIST <= low])
        np.testing.assert_array_equal(as_array(far["x"]), DIST[DIST <= high])
        y_near, y_far = as_array(near["y"]), as_array(far["y"])
        np.testing.assert_allclose(y_near, fire_formula(fire, low, DIST[DIST <= low])[:, h], atol=2e-5)
        np.testing.assert_allclose(y_far, fire_formula(fire, high, DIST[DIST <= high])[:, h], atol=2e-5)
        # query 256 is below L = 512, query 2048 above: the normalisers differ, so do the curves
        shared = len(y_near)
        diff = np.abs(y_near - y_far[:shared]).max()
        assert diff > 1e-3
        expected_diff = np.abs(fire_formula(fire, low, DIST[DIST <= low])[:, h]
                               - fire_formula(fire, high, DIST[DIST <= low])[:, h]).max()
        assert f"differ by up to {expected_diff:.3f} over the shared distances" in st["readout"]
        # the heatmap: f(psi(i - j) / psi(max(L, i))), each row with its own query
        z = as_array(st["data"][0]["z"])
        for row, i in enumerate(POS[::6]):
            keys = POS[POS <= i]
            np.testing.assert_allclose(z[row * 6, : len(keys)], fire_formula(fire, int(i), i - keys)[:, h], atol=2e-5)


def test_fire_curves_agree_when_both_queries_are_below_threshold():
    fig = I.position_biases(head_counts=(2,), fire_queries=(100, 400))
    _, _, fire = learned_schemes(2)
    for h in range(2):
        st = fig.state(scheme="fire", heads=2, head=h)
        y100, y400 = as_array(st["data"][1]["y"]), as_array(st["data"][2]["y"])
        np.testing.assert_allclose(y100, y400[: len(y100)], rtol=0, atol=1e-6)
        np.testing.assert_allclose(y400, fire_formula(fire, 400, as_array(st["data"][2]["x"]))[:, h], atol=2e-5)
        assert "differ by up to 0.000 over the shared distances" in st["readout"]


def test_fire_readout_with_the_larger_query_first():
    fig = I.position_biases(head_counts=(1,), fire_queries=(400, 100))
    st = fig.state(scheme="fire", heads=1, head=0)
    assert "differ by up to 0.000 over the shared distances" in st["readout"], st["readout"]


# ----------------------------------------------------------------------------- the container


def test_state_lookup_and_errors(clock, biases):
    assert clock.state(base=1e4, head_dim=128, train_len=4096) is clock.states[(1e4, 128, 4096)]
    assert clock.state(train_len=4096, base=1e4, head_dim=128) is clock.states[(1e4, 128, 4096)]
    with pytest.raises(ValueError, match=r"base.*head_dim.*train_len"):
        clock.state(base=1e4, head_dim=128)
    with pytest.raises(ValueError, match=r"base.*head_dim.*train_len"):
        clock.state(base=1e4, head_dim=128, train_len=4096, colour="red")
    with pytest.raises(ValueError, match=r"base must be one of \[100\.0, 10000\.0"):
        clock.state(base=123.0, head_dim=128, train_len=4096)
    with pytest.raises(ValueError, match=r"train_len must be one of \[2048, 4096, 8192, 32768, 131072\]"):
        clock.state(base=1e4, head_dim=128, train_len=4097)
    assert biases.state(scheme="alibi", heads=16, head=10)["readout"].startswith("ALiBi, head 11 of 16")
    with pytest.raises(KeyError, match="no state"):
        biases.state(scheme="alibi", heads=4, head=10)


def test_control():
    c = Control("n", "count", (1, 2, 3))
    assert c.labels == ("1", "2", "3") and c.kind == "slider"
    assert c.index(3) == 2
    with pytest.raises(ValueError, match=r"n must be one of \[1, 2, 3\], got 4"):
        c.index(4)
    with pytest.raises(ValueError, match="kind"):
        Control("n", "count", (1, 2), kind="dial")
    with pytest.raises(ValueError, match="values"):
        Control("n", "count", (1, 2, 1))
    with pytest.raises(ValueError, match="values"):
        Control("n", "count", ())
    with pytest.raises(ValueError, match="labels"):
        Control("n", "count", (1, 2), labels=("one",))


def small_figure(data, readout="r", layout=None) -> InteractiveFigure:
    fig = InteractiveFigure("t-1", "test", [Control("a", "a", (0, 1))], {"title": {"text": "t"}})
    fig.add((0,), data, readout, layout)
    return fig


def test_interactive_figure_errors():
    with pytest.raises(ValueError, match="figure_id"):
        InteractiveFigure("a b", "t", [], {})
    with pytest.raises(ValueError, match="figure_id"):
        InteractiveFigure("", "t", [], {})
    with pytest.raises(ValueError, match="control names"):
        InteractiveFigure("x", "t", [Control("a", "a", (1,)), Control("a", "b", (2,))], {})
    fig = InteractiveFigure("x", "t", [Control("a", "a", (1, 2))], {})
    with pytest.raises(ValueError, match="no states"):
        fig.payload()
    with pytest.raises(ValueError, match="one value per control"):
        fig.add((1, 2), [], "r")
    with pytest.raises(ValueError, match="a must be one of"):
        fig.add((3,), [], "r")


def test_payload_nan_and_infinity():
    x = list(range(10))
    y = [0.5, float("nan")] + [1.0] * 8
    packed = small_figure([{"type": "scatter", "x": x, "y": y, "z": [float("nan"), 2.0]}]).payload()
    t = resolve(packed["states"]["0"]["data"][0], packed["arrays"])
    assert t["y"][1] is None and t["z"] == [None, 2.0]
    assert t["x"] == x and all(type(v) is int for v in t["x"])
    for bad in (float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="finite"):
            small_figure([{"type": "scatter", "y": [1.0, bad]}]).payload()
        with pytest.raises(ValueError, match="finite"):
            small_figure([{"type": "scatter", "y": np.array([1.0] * 9 + [bad])}]).payload()


def test_payload_shares_identical_arrays_once():
    xs = np.arange(12, dtype=np.float64)
    ys = np.linspace(0.123456, 9.87654, 12)
    data = [{"type": "scatter", "x": xs, "y": ys}, {"type": "scatter", "x": xs.copy(), "y": torch.tensor(ys)},
            {"type": "scatter", "x": xs * (1 + 1e-7), "y": [1.0, 2.0]}]
    packed = small_figure(data).payload()
    st = packed["states"]["0"]["data"]
    # xs, and xs * (1 + 1e-7), are the same to 4 digits; ys is the same from numpy and torch
    assert len(packed["arrays"]) == 2
    assert st[0]["x"] == st[1]["x"] == st[2]["x"] == {"@": 0}
    assert st[0]["y"] == st[1]["y"] == {"@": 1}
    assert st[2]["y"] == [1.0, 2.0]  # short lists stay inline
    assert packed["arrays"][1] == [round4(v) for v in ys]


@pytest.mark.parametrize("name", FIGURE_NAMES)
def test_payload_of_every_figure(all_figures, name):
    fig = all_figures[name]
    packed = fig.payload()
    arrays = packed["arrays"]
    # every reference resolves, and every stored array is used
    indices = refs(packed, [])
    assert indices and all(isinstance(i, int) and 0 <= i < len(arrays) for i in indices)
    assert set(indices) == set(range(len(arrays)))
    # identical arrays are stored once: as many arrays as distinct shareable lists in the states
    texts = [json.dumps(a, separators=(",", ":")) for a in arrays]
    assert len(set(texts)) == len(texts)
    wanted = []
    for st in fig.states.values():
        shareable(expected_packed({"data": st["data"], "layout": st["layout"]}), wanted)
    shareable(expected_packed(fig.layout), wanted)
    assert len(indices) == len(wanted)
    assert len(arrays) == len(set(wanted)) < len(wanted)
    # states keyed by the controls' indices; the default state reproduces its data to 4 digits
    assert len(packed["states"]) == len(fig.states)
    assert packed["default"] == [c.values.index(v) for c, v in zip(fig.controls, fig.default)]
    key = "|".join(str(i) for i in packed["default"])
    default = fig.states[fig.default]
    got = resolve(packed["states"][key], arrays)
    assert got["readout"] == default["readout"]
    assert got["data"] == expected_packed(default["data"])
    assert got["layout"] == expected_packed(default["layout"])
    assert resolve(packed["layout"], arrays) == expected_packed(fig.layout)
    assert packed["controls"] == [{"name": c.name, "labels": list(c.labels), "kind": c.kind} for c in fig.controls]
    json.dumps(packed, allow_nan=False)


def test_payload_stores_nan_as_none(biases):
    packed = biases.payload()
    st = resolve(packed["states"]["0|1|0"], packed["arrays"])
    z = st["data"][0]["z"]
    assert z[0][1] is None and z[0][0] == 0 and z[5][2] is not None


# ----------------------------------------------------------------------------- HTML


@pytest.mark.parametrize("name", FIGURE_NAMES)
def test_html_of_every_figure(all_figures, all_html, name):
    fig, page = all_figures[name], all_html[name]
    size = len(page.encode("utf-8"))
    assert size < I.MAX_FIGURE_BYTES, f"{name}: {size} bytes"
    sliders = sum(c.kind == "slider" for c in fig.controls)
    selects = sum(c.kind == "select" for c in fig.controls)
    assert page.count('<input type="range"') == sliders
    assert page.count("<select") == selects
    for control, value in zip(fig.controls, fig.default):
        i = control.values.index(value)
        if control.kind == "slider":
            assert (f'max="{len(control.values) - 1}" step="1" value="{i}" '
                    f'data-control="{control.name}"') in page
        else:
            assert f'<option value="{i}" selected>{html_lib.escape(control.labels[i])}</option>' in page
    assert f'<p class="pe-readout">{html_lib.escape(fig.states[fig.default]["readout"])}</p>' in page
    assert page.startswith(f'<div class="pe-interactive" id="pe-{fig.figure_id}"')
    # the JSON block is the whole payload: nothing inside it closes the script early
    text = payload_json(page)
    assert "</script" not in text.lower()
    assert json.loads(text) == json.loads(json.dumps(fig.payload()))
    assert page.count("</script>") == 2
    # the fallback image is a PNG
    m = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert m is not None
    assert base64.b64decode(m.group(1)).startswith(b"\x89PNG\r\n\x1a\n")
    assert page.count("data:image/png;base64,") == 1


def test_html_without_fallback(clock):
    page = clock.html(fallback=False)
    assert "data:image/png" not in page and "<img" not in page
    assert payload_json(page) == payload_json(clock.html(fallback=True))


def test_html_escapes_script_in_data():
    evil = "</script><script>alert(1)</script>"
    fig = small_figure([{"type": "scatter", "x": [1, 2], "y": [3.0, 4.0], "name": evil}], readout=evil)
    page = fig.html(fallback=False)
    assert page.count("</script>") == 2
    assert page.lower().count("</script") == 2
    assert html_lib.escape(evil) in page
    data = json.loads(payload_json(page))
    assert data["states"]["0"]["readout"] == evil
    assert data["states"]["0"]["data"][0]["name"] == evil


def test_repr_mimebundle(score):
    bundle = score._repr_mimebundle_()
    assert bundle["text/plain"] == "interactive figure: RoPE's score against distance (6 states)"
    assert bundle["text/html"].startswith('<div class="pe-interactive" id="pe-score-distance"')


def test_plotly_js_path():
    assert I.PLOTLY_JS.startswith("plotly/") and I.PLOTLY_JS.endswith(".min.js")
    assert I.MAX_FIGURE_BYTES == 1_000_000


# ----------------------------------------------------------------------------- Plotly schema


OTHER_STATES = {
    "rope_clock": (100.0, 64, 131072),
    "score_distance": (1e6,),
    "scaling_methods": ("Qwen2 7B", "llama3", 32.0),
    "position_biases": ("fire", 12, 11),
}


@pytest.mark.parametrize("name", FIGURE_NAMES)
def test_plotly_schema(all_figures, name):
    import plotly.graph_objects as go

    fig = all_figures[name]
    for key in (fig.default, OTHER_STATES[name]):
        st = fig.state(**state_key(fig, key))
        data = plain(st["data"])
        layout = plain({**fig.layout, **st["layout"]})
        figure = go.Figure(data=data, layout=layout)
        assert len(figure.data) == len(st["data"])
    # the schema check is real: an unknown property is refused
    with pytest.raises(ValueError):
        go.Figure(data=[{**plain(fig.states[fig.default]["data"][0]), "colour": "red"}])


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("call,name", [
    (lambda: I.rope_clock(bases=[]), "bases"),
    (lambda: I.rope_clock(bases=[1.0]), "bases"),
    (lambda: I.rope_clock(bases=[100.0, 100.0]), "bases"),
    (lambda: I.rope_clock(bases=[float("inf")]), "bases"),
    (lambda: I.rope_clock(head_dims=[63]), "head_dims"),
    (lambda: I.rope_clock(head_dims=[64.5]), "head_dims"),
    (lambda: I.rope_clock(train_lens=[0]), "train_lens"),
    (lambda: I.score_distance(head_dim=0), "head_dim"),
    (lambda: I.score_distance(head_dim=63), "head_dim"),
    (lambda: I.score_distance(max_distance=1), "max_distance"),
    (lambda: I.score_distance(bases=[0.5]), "bases"),
    (lambda: I.scaling_methods(configs={}), "configs"),
    (lambda: I.scaling_methods(configs={"x": (1e4, 128)}), "configs"),
    (lambda: I.scaling_methods(factors=[0.5]), "factors"),
    (lambda: I.scaling_methods(factors=[]), "factors"),
    (lambda: I.scaling_methods(longrope={"nope": {}}), "longrope"),
    (lambda: I.position_biases(grid=1), "grid"),
    (lambda: I.position_biases(span=16, grid=17), "grid"),
    (lambda: I.position_biases(fire_queries=(0, 5)), "fire_queries"),
    (lambda: I.position_biases(fire_queries=(5,)), "fire_queries"),
    (lambda: I.position_biases(head_counts=[0]), "head_counts"),
])
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_decay_bound_bad_input():
    with pytest.raises(ValueError, match="head_dim"):
        I.decay_bound(np.array([1.0]), 0)


# ----------------------------------------------------------------------------- the book's use of them

from pathlib import Path  # noqa: E402

import nbformat  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: Where the book shows each interactive figure (issue 34).
BOOK_FIGURES = {
    "chapters/05_rope.ipynb": ["score-distance", "rope-clock"],
    "chapters/09_rope_scaling.ipynb": ["scaling-methods"],
    "chapters/11_newer_encodings.ipynb": ["position-biases"],
}


def _interactive_outputs(path: Path):
    nb = nbformat.read(path, as_version=4)
    for index, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            html_text = out.get("data", {}).get("text/html", "")
            if 'class="pe-interactive"' in html_text:
                yield index, cell, html_text


@pytest.mark.parametrize("path", sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "book").glob("*.ipynb")),
                         ids=lambda p: p.name)
def test_stored_notebooks_hold_the_figures_within_budget(path):
    """Each figure is where the book says, stored with its fallback image and under 1 MB, and its
    cell keeps it out of nbval's comparison with a stated reason and asserts its data instead."""
    rel = str(path.relative_to(ROOT))
    found = []
    for index, cell, html_text in _interactive_outputs(path):
        fid = re.search(r'id="pe-([a-z0-9-]+)"', html_text).group(1)
        found.append(fid)
        size = len(html_text.encode("utf-8"))
        assert size <= I.MAX_FIGURE_BYTES, f"{rel} cell {index}: figure {fid} is {size:,} bytes"
        assert "data:image/png;base64," in html_text, f"{rel} cell {index}: no static fallback image"
        tags = cell.metadata.get("tags", [])
        assert "nbval-ignore-output" in tags and "hide-input" in tags, f"{rel} cell {index}: tags {tags}"
        assert len(cell.metadata.get("nbval-reason", "")) > 20, f"{rel} cell {index}: no nbval-reason"
        assert cell.source.count("assert ") >= 2, f"{rel} cell {index}: the figure's data is not asserted"
    assert found == BOOK_FIGURES.get(rel, []), f"{rel}: figures {found}"


def test_the_site_hook_loads_plotly_only_where_a_figure_is():
    import sys

    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    try:
        import offline_site
    finally:
        sys.path.pop(0)
    assert offline_site.PLOTLY_JS == I.PLOTLY_JS
    with_figure = {"body": I.rope_clock(bases=[1e4], head_dims=[8], train_lens=[16]).html(fallback=False),
                   "script_files": []}
    for _ in range(2):  # called twice, still one script
        offline_site._add_plotly(None, "chapters/x", "page.html", with_figure, None)
    names = [str(js.filename) for js in with_figure["script_files"]]
    assert names == [I.PLOTLY_JS] and with_figure["script_files"][0].attributes.get("defer")
    plain = {"body": "<p>no figure, though the text names pe-interactive</p>", "script_files": []}
    offline_site._add_plotly(None, "chapters/y", "page.html", plain, None)
    assert plain["script_files"] == []


def test_the_npm_pin_matches_the_python_plotly_schema():
    """The site's Plotly.js (book/package.json) is the version the pinned plotly package
    validates against, so a spec the tests accept is one the page can draw."""
    import plotly.offline

    package = json.loads((ROOT / "book" / "package.json").read_text())
    assert package["dependencies"]["plotly.js-cartesian-dist-min"] == plotly.offline.get_plotlyjs_version()


def test_smollm2_config_matches_its_gguf():
    from companion import pretrained as pt

    path = pt.cached_smollm2_path()
    if not path.is_file():
        pytest.skip(f"SmolLM2 GGUF not cached at {path}; run `python -m companion.pretrained fetch`")
    from companion.llama import LlamaConfig, _field_value, _gguf_reader

    reader = _gguf_reader(path)
    fields = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    cfg = LlamaConfig.from_gguf_fields(fields)
    assert I.MODEL_CONFIGS["SmolLM2 135M"] == (cfg.rope_base, cfg.head_dim, cfg.context_length)


@pytest.mark.parametrize("build, match", [
    (lambda: I.rope_clock(bases=[1e4], head_dims=[8], train_lens=[16], default=(3.0, 8, 16)), "base must be one of"),
    (lambda: I.scaling_methods({"x": (1e4, 16, 128)}, (2.0,), default=("x", "xpos", 2.0)), "method must be one of"),
    (lambda: I.scaling_methods({"x": (1e4, 16, 128)}, (2.0,), default=("x", 2.0)), "default must give one value"),
    (lambda: I.position_biases(head_counts=[4], default=("alibi", 4, 7)), "head must be one of"),
    (lambda: I.position_biases(head_counts=[2, 4], default=("alibi", 2, 3)), "has no state"),
    (lambda: I.scaling_methods({"x": (1e4, 16, 128)}, (2.0,), longrope={"x": {4.0: [1.0] * 8}}), r"not one of factors"),
    (lambda: I.scaling_methods({"x": (1e4, 16, 128)}, (2.0,), longrope={"x": {2.0: [1.0] * 3}}), r"one factor per pair \(8\)"),
])
def test_defaults_and_longrope_factors_are_checked_when_built(build, match):
    with pytest.raises(ValueError, match=match):
        build()
