"""Tests for companion.lab.grid_task: the grid generator's labels and determinism, the encoder's
shapes and invariances, the schemes at a shared base, position interpolation and normalised
coordinates against their formulas (and DINOv3's RoPE in transformers, when installed), a
short training run that learns, the stored counts and flags, the summary, the command line
and bad arguments (not the chapter's accuracies, which chapters/data/12_grid.json stores)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from companion.attention import NoPE
from companion.grid import AxialRoPE, LearnedGridEmbedding, MixedRoPE, Sinusoidal2DEmbedding, grid_positions
from companion.lab import grid_task
from companion.lab.grid_task import (
    DISTRACTOR,
    EMPTY,
    EVAL_SEED,
    MARKER,
    SCHEMES,
    TARGET,
    GridBatch,
    GridTask,
    TinyGridEncoder,
    TrainSettings,
    accuracy,
    batch_digest,
    build_scheme,
    eval_batch,
    example_hits,
    main,
    make_batch,
    pack_hits,
    scale_positions,
    summarize,
    train_and_eval,
    unpack_hits,
)
from companion.utils import load_result
from helpers import U32, U64, assert_within, pair_index, pow_bound, rotation_tol

TASKS = {
    "default": GridTask(),
    "larger": GridTask().at(12),
    "tight": GridTask(grid=2, max_offset=1, n_distractors=2),  # 4 cells, all filled
    "no-distractors": GridTask(grid=5, max_offset=2, n_distractors=0),
    "crowded": GridTask(grid=6, max_offset=3, n_distractors=20),
}

TINY = TrainSettings(d_model=16, n_heads=2, n_layers=2, mlp=2, batch_size=8, eval_size=16, warmup=1,
                     log_every=2)


def read_back(row: list[int], side: int):
    """Independent reading of one grid: the cells of each token kind as (row, col) lists."""
    cells: dict[int, list[tuple[int, int]]] = {}
    for i, tok in enumerate(row):
        cells.setdefault(tok, []).append(divmod(i, side))
    return cells


@pytest.mark.parametrize("name", list(TASKS))
def test_batches_hold_one_marker_one_target_at_an_offset_in_range(name):
    task = TASKS[name]
    batch = make_batch(400, 5, task)
    side, k = task.grid, task.max_offset
    assert batch.tokens.shape == (400, side * side) and batch.tokens.dtype == torch.int64
    seen = set()
    for i, row in enumerate(batch.tokens.tolist()):
        cells = read_back(row, side)
        assert set(cells) <= {EMPTY, MARKER, TARGET, DISTRACTOR}
        assert len(cells[MARKER]) == 1 and len(cells[TARGET]) == 1
        assert len(cells.get(DISTRACTOR, [])) == task.n_distractors
        (mr, mc), (tr, tc) = cells[MARKER][0], cells[TARGET][0]
        assert batch.marker[i].tolist() == [mr, mc] and batch.target[i].tolist() == [tr, tc]
        dr, dc = tr - mr, tc - mc
        assert batch.offset[i].tolist() == [dr, dc]
        assert -k <= dr <= k and -k <= dc <= k and (dr, dc) != (0, 0)
        assert batch.labels[i].tolist() == [dr + k, dc + k]
        assert int(batch.marker_index[i]) == mr * side + mc
        seen.add((dr, dc))
    # every nonzero offset that fits is drawn (each has probability 1/((2k+1)^2 - 1) >= 1/48
    # per grid, so one is missed in 400 draws with probability <= 48 (47/48)^400 < 1e-2;
    # the seed is fixed, so this is a check of the sampler, not a flaky test)
    assert len(seen) == (2 * k + 1) ** 2 - 1


def test_offsets_are_uniform():
    """The offset is drawn first, so each of the 48 is equally likely. With 48000 grids a
    count is Binomial(48000, 1/48): mean 1000, standard deviation 31.3; 6 standard deviations
    (188) bound every count with probability > 1 - 48 * 2e-9. Drawing the marker first and
    then an offset that fits would favour small offsets (a corner marker admits only 15 of
    48): the (3, 3) offset would fall to about 0.5 of its share, far outside the bound."""
    batch = make_batch(48000, 1)
    codes = (batch.labels[:, 0] * 7 + batch.labels[:, 1]).bincount(minlength=49)
    assert int(codes[24]) == 0  # the (0, 0) offset
    counts = torch.cat([codes[:24], codes[25:]])
    assert int((counts - 1000).abs().max()) < 188
    assert math.isclose(GridTask().chance, 1 / 48)


def test_determinism_under_a_seed():
    a, b = make_batch(64, 11), make_batch(64, 11)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(make_batch(64, 12).tokens, a.tokens)
    g = torch.Generator().manual_seed(11)
    first, second = make_batch(64, g), make_batch(64, g)
    assert all(torch.equal(x, y) for x, y in zip(first, a))  # an int seed is a fresh generator
    assert not torch.equal(first.tokens, second.tokens)  # the generator advanced


def test_held_out_sets_are_fixed_per_grid():
    for side in (8, 12):
        task = GridTask().at(side)
        held = eval_batch(task, 50)
        assert all(torch.equal(x, y) for x, y in zip(held, make_batch(50, EVAL_SEED + side, task)))
        assert held.tokens.shape == (50, side * side)
    # the training stream of a run seed is not the held-out set
    train = make_batch(50, 0)
    assert not torch.equal(train.tokens, eval_batch(GridTask(), 50).tokens)


def test_task_properties():
    task = GridTask(grid=5, max_offset=2)
    assert (task.vocab_size, task.n_classes, task.seq_len) == (4, 5, 25)
    assert math.isclose(task.chance, 1 / 24)
    assert task.at(9) == GridTask(grid=9, max_offset=2)


# ----------------------------------------------------------------------------- the model


def _model(name: str, d_model: int = 16, n_heads: int = 2, n_layers: int = 2, seed: int = 0) -> TinyGridEncoder:
    torch.manual_seed(seed)
    return TinyGridEncoder(lambda: build_scheme(name, d_model, n_heads, 8), d_model=d_model, n_heads=n_heads,
                           n_layers=n_layers, mlp=2, per_layer=name in grid_task.PER_LAYER)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_forward_shapes_at_two_grid_sizes(name):
    model = _model(name)
    for side in (8, 12):
        batch = make_batch(3, 0, GridTask().at(side))
        out = model.for_grid((side, side))(batch.tokens, (side, side), batch.marker_index)
        assert out.shape == (3, 2, 7) and out.dtype == torch.float32
        assert bool(torch.isfinite(out).all())


def test_schemes_are_built_as_specified():
    kinds = {"learned": LearnedGridEmbedding, "sincos-2d": Sinusoidal2DEmbedding, "axial": AxialRoPE,
             "mixed": MixedRoPE, "nope": NoPE, "axial-b10": AxialRoPE, "mixed-b100": MixedRoPE,
             "axial-norm": AxialRoPE}
    assert set(kinds) == set(SCHEMES)
    for name, cls in kinds.items():
        assert type(build_scheme(name, 64, 4)) is cls
    assert build_scheme("learned", 64, 4).table.shape == (8, 8, 64)
    axial = build_scheme("axial", 64, 4)
    assert axial.head_dim == 16 and axial.base == 100.0
    mixed = build_scheme("mixed", 64, 4)
    assert mixed.freqs.shape == (4, 2, 8) and mixed.base == 10.0
    # mixed RoPE: one scheme per layer, each with its own frequencies; others: one shared
    model = _model("mixed", n_layers=3)
    assert len(model.schemes) == 3 and model.scheme_for(0) is not model.scheme_for(2)
    assert not torch.equal(model.scheme_for(0).freqs, model.scheme_for(1).freqs)
    model = _model("axial", n_layers=3)
    assert len(model.schemes) == 1 and model.scheme_for(0) is model.scheme_for(2)
    assert grid_task.PER_LAYER == {"mixed", "mixed-b100"} and grid_task.NORMALIZED == {"axial-norm"}
    # per_layer=None decides by the scheme's type
    auto = TinyGridEncoder(lambda: build_scheme("mixed", 16, 2), d_model=16, n_heads=2)
    assert auto.per_layer and len(auto.schemes) == 2


def test_seeded_init_is_reproducible():
    a, b, c = _model("mixed", seed=3), _model("mixed", seed=3), _model("mixed", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[key], sb[key]) for key in sa)
    assert not all(torch.equal(sa[key], sc[key]) for key in sa)


def test_the_last_block_reads_the_marker_only_and_matches_the_full_block():
    """The last block computes the marker's output alone; a bidirectional block's output at a
    token depends on that token's query only, so it equals the full block's output there.
    In float64 the two differ by summation order only: about n * 2**-53 relative for sums of
    n <= 256 terms of size O(10) here (attention sharpened by scaled weights), < 1e-11; a wrong
    query position or token would change the logits by O(0.1)."""
    for name in ("axial", "mixed", "learned"):
        model = _sharpened(name)
        batch = make_batch(6, 2)
        side = 8
        fast = model(batch.tokens, (side, side), batch.marker_index)
        pos = grid_positions((side, side))
        x = model.schemes[0].embed(model.tok(batch.tokens), pos)
        for i, block in enumerate(model.blocks):
            x = block(x, model.scheme_for(i), pos)
        full = model.heads(model.ln_f(x[torch.arange(6), batch.marker_index])).view(6, 2, 7)
        assert (fast - full).abs().max() < 1e-11
        assert full.abs().max() > 1e-3  # not trivially zero


def _sharpened(name: str) -> TinyGridEncoder:
    """A float64 model whose attention is far from uniform (q and k weights scaled by 30), so
    that what attention sees shows in the output."""
    model = _model(name).double()
    with torch.no_grad():
        for block in model.blocks:
            block.q_proj.weight.mul_(30)
            block.kv_proj.weight.mul_(30)
    return model


def test_nope_cannot_tell_offsets_apart():
    """Without positions a bidirectional encoder sees only the multiset of tokens, which is
    the same for every grid of a task: every grid gets the same logits, up to the order of
    float64 sums over 64 keys (about 64 * 2**-53 relative on values of O(1), < 1e-13). With
    axial RoPE the same weights give logits that differ by O(0.1) from grid to grid."""
    batch = make_batch(32, 4)
    out = _sharpened("nope")(batch.tokens, (8, 8), batch.marker_index)
    assert (out - out[:1]).abs().max() < 1e-12
    out = _sharpened("axial")(batch.tokens, (8, 8), batch.marker_index)
    assert (out - out[:1]).abs().max() > 1e-2


def test_for_grid_resizes_a_learned_table_only():
    model = _model("learned")
    assert model.for_grid((8, 8)) is model
    big = model.for_grid((12, 12))
    assert big is not model and big.schemes[0].table.shape == (12, 12, 16)
    assert model.schemes[0].table.shape == (8, 8, 16)  # the trained model is unchanged
    assert torch.equal(big.tok.weight, model.tok.weight)
    expected = model.schemes[0].resized((12, 12)).table
    assert torch.equal(big.schemes[0].table, expected)
    axial = _model("axial")
    assert axial.for_grid((16, 16)) is axial
    # without resizing, the learned table has no rows beyond 8
    batch = make_batch(2, 0, GridTask().at(12))
    with pytest.raises(IndexError, match="pos on axis 0 must be in"):
        model(batch.tokens, (12, 12), batch.marker_index)


# ----------------------------------------------------------------------------- bases, interpolation, normalised coordinates


def rotate_ref(x, angles, layout):
    """The rotation written out in float64: pair j = (a, b) -> (a cos t - b sin t, b cos t +
    a sin t), ``angles`` broadcasting to ``(..., seq, r/2)``, the whole head rotated."""
    x = x.double()
    ia, ib = pair_index(layout, x.shape[-1])
    a, b, c, s = x[..., ia], x[..., ib], angles.cos(), angles.sin()
    out = torch.empty(torch.broadcast_shapes(a.shape, c.shape)[:-1] + (x.shape[-1],), dtype=torch.float64)
    out[..., ia] = a * c - b * s
    out[..., ib] = b * c + a * s
    return out


@pytest.mark.parametrize("base", [10.0, 100.0])
def test_axial_and_mixed_at_a_shared_base_have_the_same_frequencies(base):
    """At a shared base both schemes turn pair i of an axis at base ** (-4 i / head_dim): axial
    along its axis, each mixed head along its own direction, with the same speeds (the
    magnitude of a mixed pair's (F_0, F_1))."""
    axial = build_scheme("axial" if base == 100.0 else "axial-b10", 64, 4)
    mixed = build_scheme("mixed" if base == 10.0 else "mixed-b100", 64, 4)
    assert axial.base == base and mixed.base == base
    want = torch.tensor([base ** (-4 * i / 16) for i in range(4)], dtype=torch.float64)
    per_axis = axial.freqs.double()
    torch.testing.assert_close(per_axis[0, :4], want, rtol=pow_bound(base), atol=0)
    torch.testing.assert_close(per_axis[1, 4:], want, rtol=pow_bound(base), atol=0)
    assert not per_axis[0, 4:].any() and not per_axis[1, :4].any()
    # cos and sin of the float32 direction, then the float32 product: a few U32 more
    speed = mixed.freqs.detach().double().norm(dim=1)  # (heads, P)
    torch.testing.assert_close(speed, want.repeat(2).expand(4, 8), rtol=pow_bound(base) + 8 * U32, atol=0)


def test_the_slowest_pair_at_offset_23_as_the_docstring_says():
    """The confound the same-base schemes remove: at rope-vit's defaults (mixed base 10,
    axial base 100) the slowest pair of a 16-dim head turns 4.1 rad at an offset of 23
    patches in one scheme and 0.73 rad in the other."""
    mixed = build_scheme("mixed", 64, 4).freqs.detach().double().norm(dim=1).min()
    axial = build_scheme("axial", 64, 4).freqs.double()
    axial = axial[axial > 0].min()
    assert round(23 * float(mixed), 1) == 4.1 and round(23 * float(axial), 2) == 0.73


def _qk(seq, heads=4, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, seq, d, dtype=torch.float64, generator=g),
            torch.randn(2, heads, seq, d, dtype=torch.float64, generator=g))


@pytest.mark.parametrize("kind", ["axial-interleaved", "axial-half", "mixed"])
@pytest.mark.parametrize("factors", [(8 / 24, 8 / 24), (0.5, 2.0), (math.pi / 2, math.pi / 2)])
def test_scale_positions_reads_fractional_positions(kind, factors):
    """The scaled copy at integer positions p rotates as the original would at the fractional
    positions s_a p_a: the reference takes the original frequencies F (float64 for axial; the
    float32 values of mixed's parameter) and angle sum_a (s_a p_a) F[a, j], in float64. The
    copy's float64 path differs by the rounding of the angles (rotation_tol at U64) and, for
    mixed, by its float32 frequencies s_a F rounded once: an angle error of at most U32 times
    the angle's magnitude."""
    torch.manual_seed(0)
    scheme = {"axial-interleaved": AxialRoPE(16, 2), "axial-half": AxialRoPE(16, 2, layout="half"),
              "mixed": MixedRoPE(16, 4)}[kind]
    before = scheme.freqs.detach().clone()
    scaled = scale_positions(scheme, factors)
    assert type(scaled) is type(scheme) and torch.equal(scheme.freqs, before)  # the original is unchanged
    pos = grid_positions((5, 7)) * 3
    q, k = _qk(35)
    q2, k2 = scaled.rotate(q, k, pos, pos.flip(0))
    freqs = scheme.freqs64 if kind != "mixed" else scheme.freqs.detach().double()
    frac = pos.double() * torch.tensor(factors, dtype=torch.float64)
    for x, x2, p in ((q, q2, frac), (k, k2, frac.flip(0))):
        if kind == "mixed":
            theta = torch.einsum("sa,hap->hsp", p, freqs)
            big = torch.einsum("sa,hap->hsp", p.abs(), freqs.abs())
            tol = rotation_tol(x, big, scheme.layout, 16, angle_err=U32 * big, u=U64)
        else:
            theta, big = p @ freqs, p.abs() @ freqs.abs()
            tol = rotation_tol(x, big, scheme.layout, 16, u=U64)
        assert_within(x2, rotate_ref(x, theta, scheme.layout), tol)
    if kind == "mixed":
        assert isinstance(scaled.freqs, torch.nn.Parameter) and scaled.freqs.requires_grad
    assert torch.equal(scale_positions(scheme, 1.0).freqs, scheme.freqs)


def test_for_grid_interpolates_every_layer_from_the_training_grid():
    """for_grid(G, interpolate_from=8): each layer's RoPE reads p as 8 p / G, and for G = 8
    the model is unchanged; a model without a grid RoPE refuses."""
    for name in ("axial", "mixed"):
        model = _model(name, n_layers=2)
        assert model.for_grid((8, 8), interpolate_from=(8, 8)) is model
        big = model.for_grid((24, 12), interpolate_from=(8, 8))
        assert big is not model and torch.equal(big.tok.weight, model.tok.weight)
        for mine, orig in zip(big.schemes, model.schemes):
            torch.testing.assert_close(mine.freqs.detach().double(),
                                       orig.freqs.detach().double() * torch.tensor([[8 / 24], [8 / 12]], dtype=torch.float64),
                                       rtol=U32, atol=0)
    with pytest.raises(ValueError, match="interpolate_from needs a model with a grid RoPE"):
        _model("learned").for_grid((12, 12), interpolate_from=(8, 8))
    with pytest.raises(ValueError, match="interpolate_from must be >= 1"):
        _model("axial").for_grid((12, 12), interpolate_from=(0, 8))
    with pytest.raises(ValueError, match="interpolate_from must be a"):
        _model("axial").for_grid((12, 12), interpolate_from=8)


def dinov3_angles(side, head_dim, base=100.0):
    """DINOv3's RoPE angles for a side x side grid, written from its formula in float64:
    patch centres c = 2 (p + 1/2) / side - 1 per axis, pair i of an axis at 2 pi c base **
    (-4 i / head_dim); the row's head_dim / 4 pairs first, then the column's (half layout)."""
    c = 2 * (grid_positions((side, side)).double() + 0.5) / side - 1
    f = torch.tensor([base ** (-4 * i / head_dim) for i in range(head_dim // 4)], dtype=torch.float64)
    return torch.cat([2 * math.pi * c[:, :1] * f, 2 * math.pi * c[:, 1:] * f], dim=-1)


def scores(q, k):
    return q @ k.transpose(-1, -2)


def score_tol(q, k, err):
    """A bound on |q'.k' - q''.k''| for two rotations of q and k whose coordinates differ from
    the exact rotation by at most err (|a| + |b|) on each pair: each pair's term differs by
    at most 2 err (|q_a| + |q_b|)(|k_a| + |k_b|) (rotations keep pair norms), summed over pairs;
    the dot products add 2 head_dim U64 relative."""
    ia, ib = pair_index("half", q.shape[-1])
    qa, ka = q.abs()[..., ia] + q.abs()[..., ib], k.abs()[..., ia] + k.abs()[..., ib]
    return (2 * err + 2 * q.shape[-1] * U64) * (qa @ ka.transpose(-1, -2))


@pytest.mark.parametrize("side", [8, 12, 24])
def test_normalised_coordinates_are_dinov3s_rope(side):
    """The "axial-norm" scheme of an 8 x 8 training grid, at a test grid with interpolate_from
    = 8, scores q and k as DINOv3's RoPE on coordinates normalised to that grid: the shift of
    the coordinates adds one angle to every query and key and cancels in q.k (not in q' and
    k' themselves). Both in float64; each angle is at most (2 pi) 2 and our frequencies
    carry a few U64, so each coordinate is within U64 (4 * 4 pi + 16) (|a| + |b|) of exact."""
    model = TinyGridEncoder(lambda: build_scheme("axial-norm", 64, 4, 8), d_model=64, n_heads=4)
    scheme = model.for_grid((side, side), interpolate_from=(8, 8)).schemes[0]
    q, k = _qk(side * side)
    pos = grid_positions((side, side))
    got = scores(*scheme.rotate(q, k, pos, pos))
    theta = dinov3_angles(side, 16)
    want = scores(rotate_ref(q, theta, "half"), rotate_ref(k, theta, "half"))
    assert_within(got, want, score_tol(q, k, U64 * (16 * math.pi + 16)))
    # the rotated vectors themselves differ (by the shift's angle): this is not a tautology
    assert (scheme.rotate(q, k, pos, pos)[0] - rotate_ref(q, theta, "half")).abs().max() > 0.1


@pytest.mark.parametrize("side", [8, 24])
def test_normalised_coordinates_match_transformers_dinov3(side):
    """Against transformers' DINOv3ViTRopePositionEmbedding and its rotation (half layout,
    ``q cos + rotate_half(q) sin``), whose tables are float32: its angles 2 pi c f (at most
    2 pi) carry the rounding of c (3 U32), of f (pow_bound(100)) and of two products (2 U32),
    and cos/sin 2 U32 more, so each coordinate is within (2 pi (pow_bound(100) / U32 + 5) + 4)
    U32 (|a| + |b|) of exact."""
    mod = pytest.importorskip("transformers.models.dinov3_vit.modeling_dinov3_vit")
    cfg = pytest.importorskip("transformers.models.dinov3_vit.configuration_dinov3_vit")
    config = cfg.DINOv3ViTConfig(hidden_size=64, num_attention_heads=4, patch_size=1, image_size=side,
                                 rope_theta=100.0)
    rope = mod.DINOv3ViTRopePositionEmbedding(config).eval()  # in training it rescales the coordinates at random
    cos, sin = rope(torch.zeros(1, 3, side, side))
    q, k = _qk(side * side)
    hf = [x * cos.double() + mod.rotate_half(x) * sin.double() for x in (q, k)]
    model = TinyGridEncoder(lambda: build_scheme("axial-norm", 64, 4, 8), d_model=64, n_heads=4)
    scheme = model.for_grid((side, side), interpolate_from=(8, 8)).schemes[0]
    pos = grid_positions((side, side))
    got = scores(*scheme.rotate(q, k, pos, pos))
    err = (2 * math.pi * (pow_bound(100.0) / U32 + 5) + 4) * U32 + U64 * (16 * math.pi + 16)
    assert_within(got, scores(*hf), score_tol(q, k, err))


def test_axial_norm_trains_on_its_own_grid_with_frequencies_4_pi_over_g():
    scheme = build_scheme("axial-norm", 64, 4, 8)
    assert scheme.layout == "half" and scheme.base == 100.0
    want = AxialRoPE(16, 2, base=100.0).freqs64 * (4 * math.pi / 8)
    torch.testing.assert_close(scheme.freqs64, want, rtol=2 * U64, atol=0)
    torch.testing.assert_close(scheme.freqs.double(), want, rtol=U32, atol=0)


# ----------------------------------------------------------------------------- stored flags and digests


def test_pack_hits_round_trip_and_layout():
    """The first flag in the high bit of the first byte, zero padding: written out by hand."""
    flags = [True, False, True, True, False, False, False, True, True, True, False]
    assert pack_hits(flags) == f"{0b10110001:02x}{0b11000000:02x}"
    assert pack_hits(torch.tensor(flags)) == pack_hits(flags)
    for n in (0, 1, 8, 9, 1000):
        x = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.3
        text = pack_hits(x)
        assert len(text) == 2 * math.ceil(n / 8)
        assert unpack_hits(text, n).tolist() == x.tolist()
    with pytest.raises(ValueError, match=r"text must hold 2 \* ceil\(n / 8\) = 4 hex characters for n = 11"):
        unpack_hits("b1", 11)
    with pytest.raises(ValueError, match="text sets padding bits past n = 9"):
        unpack_hits("b1ff", 9)
    with pytest.raises(ValueError, match="text must be a hex string"):
        unpack_hits("zz", 8)
    with pytest.raises(TypeError, match="text must be a hex string"):
        unpack_hits(b"b1", 8)
    with pytest.raises(TypeError, match="hits must be a 1-D sequence of bools"):
        pack_hits([1, 0, 1])
    with pytest.raises(TypeError, match="hits must be a 1-D sequence of bools"):
        pack_hits(torch.ones(2, 2, dtype=torch.bool))


def test_batch_digest_identifies_the_examples():
    a = eval_batch(GridTask().at(12), 50)
    assert batch_digest(a) == batch_digest(eval_batch(GridTask().at(12), 50))
    assert batch_digest(a) != batch_digest(eval_batch(GridTask().at(12), 51))
    assert batch_digest(a) != batch_digest(eval_batch(GridTask().at(16), 50))
    moved = a._replace(labels=a.labels.flip(0))
    assert batch_digest(moved) != batch_digest(a)
    with pytest.raises(TypeError, match="batch must be a GridBatch"):
        batch_digest(a.tokens)


def test_runs_store_counts_flags_and_the_same_examples():
    """Per grid and evaluation: the number right of the number scored, and which, read back
    against the returned model scored again; the held-out grids are identical for two schemes
    (same digest) and differ from grid to grid."""
    grids = (4, 6)
    task = GridTask(grid=4)
    runs = {}
    for name in ("axial", "axial-norm", "learned"):
        res, model = train_and_eval(name, 0, 3, grids=grids, task=task, settings=TINY, return_model=True)
        runs[name] = res
        interp = 4 if name == "axial-norm" else None
        for kind in ("full", "shifted", "window", "interpolated"):
            for g, text in res["hits"][kind].items():
                n = res["evaluated"][kind][g]
                assert n == TINY.eval_size
                flags = unpack_hits(text, n)
                assert res["correct"][kind][g] == int(flags.sum())
        for g in grids:
            batch = eval_batch(task.at(g), TINY.eval_size)
            want = example_hits(model, batch, g, interpolate_from=interp).all(-1)
            assert unpack_hits(res["hits"]["full"][str(g)], TINY.eval_size).tolist() == want.tolist()
            assert res["accuracy"][str(g)] == res["correct"]["full"][str(g)] / TINY.eval_size
            assert res["eval_digest"][str(g)] == batch_digest(batch)
        if name == "axial":  # position interpolation is scored for the integer-position RoPEs only
            want = example_hits(model, eval_batch(task.at(6), TINY.eval_size), 6, interpolate_from=4).all(-1)
            assert unpack_hits(res["hits"]["interpolated"]["6"], TINY.eval_size).tolist() == want.tolist()
        else:
            assert res["interpolated_accuracy"] == {} and res["hits"]["interpolated"] == {}
        assert set(res["correct"]["shifted"]) == {"6"}
    assert runs["axial"]["eval_digest"] == runs["learned"]["eval_digest"]
    assert runs["axial"]["eval_digest"]["4"] != runs["axial"]["eval_digest"]["6"]


# ----------------------------------------------------------------------------- training


def test_a_short_axial_run_learns():
    """300 steps of batch 32 with the default model and axial RoPE. Chance is 1/48 = 0.021;
    on 500 held-out grids its binomial standard deviation is 0.0064, so 0.5 is more than 70
    of them above chance. This run reached 1.0 on 2 threads, on 1 thread with torch's scalar
    kernels (ATEN_CPU_CAPABILITY=default) and with MKL_CBWR=COMPATIBLE: the threshold is far
    below that, since other numeric configurations change the training trajectory, and far
    above anything an untrained or position-blind model reaches."""
    res = train_and_eval("axial", 0, 300, grids=(8,), settings=replace(TrainSettings(), eval_size=500,
                                                                        batch_size=32, warmup=50))
    assert res["accuracy"]["8"] > 0.5
    assert res["loss_curve"]["loss"][-1] < res["loss_curve"]["loss"][0] - 1.0  # from ~2 ln 7 = 3.9


def test_train_and_eval_is_deterministic_and_reports_every_field():
    one = train_and_eval("mixed", 0, 5, grids=(4, 6), task=GridTask(grid=4), settings=TINY)
    two = train_and_eval("mixed", 0, 5, grids=(4, 6), task=GridTask(grid=4), settings=TINY)
    for r in (one, two):
        assert r.pop("train_seconds") > 0 and r.pop("eval_seconds") > 0
    assert one == two
    other = train_and_eval("mixed", 1, 5, grids=(4, 6), task=GridTask(grid=4), settings=TINY)
    assert other["final_loss"] != one["final_loss"]
    assert set(one["accuracy"]) == {"4", "6"} and set(one["axis_accuracy"]["6"]) == {"dr", "dc"}
    assert all(0.0 <= a <= 1.0 for a in one["accuracy"].values())
    # windows of log_every = 2 steps, the last one partial
    assert one["loss_curve"]["step"] == [2, 4, 5]
    assert len(one["loss_curve"]["loss"]) == 3
    assert one["task"]["grid"] == 4 and one["settings"]["batch_size"] == TINY.batch_size
    assert math.isclose(one["chance"], 1 / 48)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_scheme_trains_a_step_and_evaluates_a_larger_grid(name):
    res = train_and_eval(name, 0, 2, grids=(8, 10), settings=TINY)
    assert math.isfinite(res["final_loss"]) and set(res["accuracy"]) == {"8", "10"}


def test_accuracy_counts_both_heads():
    model = _model("axial")
    batch = make_batch(40, 0)
    res = accuracy(model, batch, 8, chunk=7)
    with torch.no_grad():
        pred = model(batch.tokens, (8, 8), batch.marker_index).argmax(-1)
    hit = pred == batch.labels
    assert res["both"] == float(hit.all(-1).double().mean())
    assert res["dr"] == float(hit[:, 0].double().mean()) and res["dc"] == float(hit[:, 1].double().mean())
    assert res["both"] <= min(res["dr"], res["dc"])


def test_summarize_means_minima_and_maxima():
    def run(scheme, a8, a16):
        return {"scheme": scheme, "accuracy": {"8": a8, "16": a16}}

    runs = [run("axial", 1.0, 0.5), run("axial", 0.9, 0.2), run("nope", 0.02, 0.03), run("axial", 0.8, 0.2)]
    s = summarize(runs)
    assert list(s) == ["axial", "nope"]
    row = s["axial"]["by_grid"]["16"]
    assert s["axial"]["seeds"] == 3 and row["min"] == 0.2 and row["max"] == 0.5
    assert math.isclose(row["mean"], 0.3)
    assert s["nope"]["by_grid"]["8"] == {"mean": 0.02, "min": 0.02, "max": 0.02}
    assert s["axial"]["interpolated"] == {}  # runs stored before the diagnostic existed
    runs = [dict(run("axial", 1.0, 0.5), interpolated_accuracy={"16": 0.1}),
            dict(run("axial", 1.0, 0.5), interpolated_accuracy={"16": 0.3})]
    row = summarize(runs)["axial"]["interpolated"]["16"]
    assert math.isclose(row["mean"], 0.2) and (row["min"], row["max"]) == (0.1, 0.3)


def test_command_line_writes_a_result(tmp_path):
    out = tmp_path / "grid.json"
    assert main(["--out", str(out), "--schemes", "nope", "axial", "--seeds", "0", "--steps", "2",
                 "--grids", "8", "12", "--eval-size", "8", "--threads", "1", "--skip-reduced"]) == 0
    payload = load_result(out)
    assert payload["provenance"]["command"].startswith("python -m companion.lab.grid_task --out")
    data = payload["data"]
    assert [r["scheme"] for r in data["runs"]] == ["nope", "axial"]
    assert list(data["summary"]) == ["nope", "axial"]
    assert set(data["summary"]["axial"]["by_grid"]) == {"8", "12"}
    assert data["steps"] == 2 and data["settings"]["eval_size"] == 8 and "reduced" not in data
    assert data["eval_seed"] == EVAL_SEED
    assert all(r["eval_digest"] == data["eval_digest"] for r in data["runs"])
    assert data["eval_digest"]["12"] == batch_digest(eval_batch(GridTask().at(12), 8))


# ----------------------------------------------------------------------------- bad input


def test_bad_task_arguments():
    with pytest.raises(ValueError, match=r"grid \(3\) must be >= max_offset \+ 1 = 4"):
        GridTask(grid=3)
    with pytest.raises(ValueError, match="n_distractors .* at most 2"):
        GridTask(grid=2, max_offset=1, n_distractors=3)
    with pytest.raises(ValueError, match="max_offset must be >= 1"):
        GridTask(max_offset=0)
    with pytest.raises(TypeError, match="n_distractors must be an int"):
        GridTask(n_distractors=1.0)
    with pytest.raises(ValueError, match="grid must be >= 1"):
        GridTask().at(0)


def test_bad_batch_arguments():
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        make_batch(0, 0)
    with pytest.raises(ValueError, match="generator must be >= 0"):
        make_batch(4, -1)
    with pytest.raises(TypeError, match="generator must be an int"):
        make_batch(4, "0")
    with pytest.raises(TypeError, match="task must be a GridTask"):
        make_batch(4, 0, {"grid": 8})
    with pytest.raises(TypeError, match="task must be a GridTask"):
        eval_batch(8)


def test_build_scheme_errors():
    with pytest.raises(ValueError, match="name must be one of"):
        build_scheme("rope")
    with pytest.raises(ValueError, match="name must be one of"):
        build_scheme(None)
    with pytest.raises(ValueError, match=r"d_model \(30\) must be a multiple of n_heads \(4\)"):
        build_scheme("axial", 30, 4)
    with pytest.raises(ValueError, match="n_heads must be >= 1"):
        build_scheme("axial", 64, 0)
    with pytest.raises(TypeError, match="grid must be an int"):
        build_scheme("learned", 64, 4, (8, 8))


def test_bad_model_arguments():
    with pytest.raises(TypeError, match="scheme_factory must be a callable"):
        TinyGridEncoder(NoPE())
    with pytest.raises(TypeError, match="scheme_factory must return a PositionScheme"):
        TinyGridEncoder(lambda: "axial")
    with pytest.raises(ValueError, match=r"d_model \(10\) must be a multiple of n_heads \(4\)"):
        TinyGridEncoder(NoPE, d_model=10)
    with pytest.raises(ValueError, match="MixedRoPE"):
        TinyGridEncoder(lambda: MixedRoPE(16, 2), d_model=64, n_heads=4)  # built for 2 heads
    with pytest.raises(TypeError, match="per_layer must be a bool or None"):
        TinyGridEncoder(NoPE, per_layer=1)
    model = _model("axial")
    batch = make_batch(2, 0)
    with pytest.raises(ValueError, match="tokens must hold shape"):
        model(batch.tokens, (8, 9), batch.marker_index)
    with pytest.raises(ValueError, match="shape must be a"):
        model(batch.tokens, 8, batch.marker_index)
    with pytest.raises(ValueError, match=r"marker_index must have shape \(2,\)"):
        model(batch.tokens, (8, 8), batch.marker_index[:1])
    with pytest.raises(IndexError, match=r"marker_index must lie in \[0, 64\)"):
        model(batch.tokens, (8, 8), batch.marker_index + 64)
    with pytest.raises(TypeError, match="marker_index must hold integer"):
        model(batch.tokens, (8, 8), batch.marker_index.float())
    with pytest.raises(IndexError, match=r"tokens must lie in \[0, 4\)"):
        model(batch.tokens + 4, (8, 8), batch.marker_index)


def test_bad_training_arguments():
    with pytest.raises(ValueError, match="scheme_name must be one of"):
        train_and_eval("rope", 0, 1, settings=TINY)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        train_and_eval("nope", 0, 0, settings=TINY)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        train_and_eval("nope", -1, 1, settings=TINY)
    with pytest.raises(TypeError, match="settings must be a TrainSettings"):
        train_and_eval("nope", 0, 1, settings={"lr": 1e-3})
    with pytest.raises(TypeError, match="task must be a GridTask"):
        train_and_eval("nope", 0, 1, task=8, settings=TINY)
    with pytest.raises(ValueError, match=r"grid \(2\) must be >= max_offset \+ 1 = 4"):
        train_and_eval("nope", 0, 1, grids=(8, 2), settings=TINY)
    with pytest.raises(TypeError, match="grids must be a non-empty sequence"):
        train_and_eval("nope", 0, 1, grids=(), settings=TINY)
    with pytest.raises(ValueError, match=r"d_model \(10\) must be a multiple of n_heads \(4\)"):
        TrainSettings(d_model=10, n_heads=4)
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        TrainSettings(lr=0.0)
    with pytest.raises(ValueError, match="log_every must be >= 1"):
        TrainSettings(log_every=0)
    with pytest.raises(TypeError, match="batch must be a GridBatch"):
        accuracy(_model("nope"), make_batch(2, 0).tokens, 8)
    with pytest.raises(ValueError, match="not side \\* side = 144"):
        accuracy(_model("nope"), make_batch(2, 0), 12)
    assert isinstance(make_batch(1, 0), GridBatch)


def test_window_mask_when_the_chunk_equals_the_grid_size():
    """A 2-D window mask is (q, k); with as many grids in a chunk as tokens in a grid, a bare
    2-D mask would be ambiguous with a (batch, k) padding mask: the model passes it as
    (1, 1, q, k), so any chunk size gives the same accuracy."""
    model = _model("axial")
    batch = make_batch(16, 0, GridTask().at(4))
    a = accuracy(model, batch, 4, chunk=16, window=1)   # 16 grids of 4 x 4 = 16 tokens
    b = accuracy(model, batch, 4, chunk=5, window=1)
    assert a == b


# ----------------------------------------------------------------------------- the command line's checks


class _WorkStarted(Exception):
    pass


@pytest.fixture
def no_work(monkeypatch):
    """run_all, reduced_run and save_result replaced by guards: a bad flag must stop the command
    before them. Returns the list of the calls the guards saw (name, args, kwargs)."""
    calls = []

    def guard(name):
        def fn(*args, **kwargs):
            calls.append((name, args, kwargs))
            raise _WorkStarted
        return fn

    for name in ("run_all", "reduced_run", "save_result"):
        monkeypatch.setattr(grid_task, name, guard(name))
    return calls


@pytest.mark.parametrize("flag, values, message", [
    ("--steps", ["0"], "steps must be >= 1, got 0"),
    ("--threads", ["0"], "threads must be >= 1, got 0"),
    ("--seeds", ["-1"], "seeds must be >= 0, got -1"),
    ("--seeds", ["1", "1"], "seeds must not repeat a value"),
    ("--grids", ["0"], "grids must be >= 1, got 0"),
    ("--grids", ["3"], "grids must be >= max_offset + 1 = 4, so that every offset fits in the grid, got 3"),
    ("--grids", ["8", "8"], "grids must not repeat a value"),
    ("--eval-size", ["0"], "eval_size must be >= 1, got 0"),
    ("--schemes", ["nope", "nope"], "schemes must not repeat a value"),
])
def test_command_line_checks_every_flag_before_work(tmp_path, capsys, no_work, flag, values, message):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "g.json"), flag, *values])
    assert exc.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err
    assert no_work == []


def test_command_line_out_an_existing_folder(tmp_path, capsys, no_work):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), "--steps", "1", "--skip-reduced"])
    assert exc.value.code == 2
    assert f"argument --out: out must be a file path, got the existing folder {str(tmp_path)!r}" in capsys.readouterr().err
    assert no_work == []


def test_command_line_valid_flags_reach_run_all_unchanged(tmp_path, no_work):
    """Valid flags (a grid of max_offset + 1 = 4 included) reach run_all as parsed."""
    with pytest.raises(_WorkStarted):
        main(["--out", str(tmp_path / "g.json"), "--schemes", "axial", "--seeds", "0", "--steps", "3",
              "--grids", "8", "4", "--eval-size", "5", "--threads", "1"])
    (name, args, kwargs), = no_work
    assert name == "run_all" and args == (["axial"], [0], 3)
    assert kwargs["grids"] == [8, 4] and kwargs["settings"] == replace(TrainSettings(), eval_size=5)
    no_work.clear()
    with pytest.raises(_WorkStarted):
        main(["--out", str(tmp_path / "g.json")])
    (name, args, kwargs), = no_work
    assert args == (list(SCHEMES), [0, 1, 2, 3, 4], grid_task.STEPS) and kwargs["grids"] == list(grid_task.GRIDS)
    assert kwargs["settings"] == TrainSettings()
