"""The scheme protocol and the reference attention, checked against torch's own SDPA."""

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from companion import HOOKS, NoPE, PositionScheme, attention, causal_mask

from helpers import TableBias as _TableBias
from helpers import qkv as _qkv
from helpers import rand_native as rand

qkv = partial(_qkv, b=2, h=3, lq=5, lk=5, d=8)


class TableBias(_TableBias):
    """helpers.TableBias with this file's default ``max_dist`` of 4."""

    def __init__(self, heads, max_dist=4):
        super().__init__(heads, max_dist)


class ScoreScheme(PositionScheme):
    """A test scheme with content-dependent logit and value terms (Shaw-like)."""

    def __init__(self, d, max_dist=3):
        super().__init__()
        self.max_dist = max_dist
        self.ak = torch.nn.Parameter(rand(2 * max_dist + 1, d, seed=8))
        self.av = torch.nn.Parameter(rand(2 * max_dist + 1, d, seed=9))

    def _rel(self, q_pos, k_pos):
        return (k_pos[None, :] - q_pos[:, None]).clamp(-self.max_dist, self.max_dist) + self.max_dist

    def score(self, q, k, q_pos, k_pos):
        return torch.einsum("bhid,ijd->bhij", q, self.ak[self._rel(q_pos, k_pos)])

    def score_values(self, weights, q_pos, k_pos):
        return torch.einsum("bhij,ijd->bhid", weights, self.av[self._rel(q_pos, k_pos)])


class Negate(PositionScheme):
    """A rotate hook that is easy to predict: flips the sign of odd positions' queries."""

    def rotate(self, q, k, q_pos, k_pos):
        sign = torch.where(q_pos % 2 == 1, -1.0, 1.0).to(q.dtype)
        return q * sign[:, None], k


# ----------------------------------------------------------------------------- agreement with SDPA


@pytest.mark.parametrize("causal", [False, True])
def test_nope_matches_sdpa(causal):
    q, k, v = qkv()
    ours = attention(q, k, v, NoPE(), causal=causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(ours, ref)


def test_default_scheme_is_nope():
    q, k, v = qkv()
    torch.testing.assert_close(attention(q, k, v), attention(q, k, v, NoPE()))


def test_bias_hook_matches_sdpa_with_float_mask():
    q, k, v = qkv(h=4)
    scheme = TableBias(4)
    pos = torch.arange(5)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=scheme.bias(pos, pos))
    torch.testing.assert_close(attention(q, k, v, scheme), ref)


def test_score_hook_formula():
    q, k, v = qkv(lq=6, lk=6)
    s = ScoreScheme(8)
    pos = torch.arange(6)
    rel = s._rel(pos, pos)
    logits = (q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, s.ak[rel])) / math.sqrt(8)
    w = logits.softmax(-1)
    ref = w @ v + torch.einsum("bhij,ijd->bhid", w, s.av[rel])
    out, weights = attention(q, k, v, s, return_weights=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(weights, w)


def test_rotate_hook_is_applied_before_logits():
    q, k, v = qkv()
    pos = torch.arange(5)
    sign = torch.where(pos % 2 == 1, -1.0, 1.0).double()
    ref = F.scaled_dot_product_attention(q * sign[:, None], k, v)
    torch.testing.assert_close(attention(q, k, v, Negate()), ref)


def test_scale_argument():
    q, k, v = qkv()
    ref = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    torch.testing.assert_close(attention(q, k, v, scale=1.0), ref)


def test_grouped_query_attention_matches_repeated_heads():
    q, k, v = qkv(h=6, hk=2)
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), is_causal=True
    )
    torch.testing.assert_close(attention(q, k, v, causal=True), ref)


def test_boolean_and_float_masks():
    q, k, v = qkv()
    keep = rand(2, 1, 5, 5, seed=11) > -0.5
    keep[..., 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(attention(q, k, v, attn_mask=keep), ref)
    add = rand(2, 3, 5, 5, seed=12)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=add)
    torch.testing.assert_close(attention(q, k, v, attn_mask=add), ref)


# ----------------------------------------------------------------------------- positions and masks


def test_kv_cache_decoding_defaults_to_last_positions():
    q, k, v = qkv(lq=7, lk=7)
    full = attention(q, k, v, TableBias(3), causal=True)
    step = attention(q[:, :, -1:], k, v, TableBias(3), causal=True)
    torch.testing.assert_close(step, full[:, :, -1:])


def test_per_row_positions_with_left_padding():
    # Row 1 is row 0 shifted right by two pad tokens; with positions cumsum(mask)-1 and the
    # pads masked out, its real tokens must get exactly row 0's outputs.
    q, k, v = qkv(b=1, lq=5, lk=5)
    scheme = TableBias(3)
    ref = attention(q, k, v, scheme, causal=True)
    pad = lambda t: torch.cat([torch.zeros_like(t[:, :, :2]), t], dim=2)  # noqa: E731
    qp, kp, vp = (torch.cat([torch.cat([t, torch.zeros_like(t[:, :, :2])], 2), pad(t)]) for t in (q, k, v))
    mask = torch.tensor([[1] * 5 + [0, 0], [0, 0] + [1] * 5])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = mask.bool()[:, None, None, :]
    out = attention(qp, kp, vp, scheme, pos, pos, causal=True, attn_mask=keep)
    torch.testing.assert_close(out[0:1, :, :5], ref)
    torch.testing.assert_close(out[1:2, :, 2:], ref)


def test_causal_mask_by_position():
    m = causal_mask(torch.tensor([3, 4]), torch.arange(5))
    assert m.tolist() == [[True] * 4 + [False], [True] * 5]
    per_row = causal_mask(torch.tensor([[0, 1], [5, 6]]), torch.tensor([[0, 1], [5, 6]]))
    assert per_row.shape == (2, 2, 2)


def test_fully_masked_row_gives_zero_not_nan():
    q, k, v = qkv()
    q.requires_grad_(True)
    keep = torch.ones(5, 5, dtype=torch.bool)
    keep[2] = False
    out, w = attention(q, k, v, attn_mask=keep, return_weights=True)
    assert torch.all(out[:, :, 2] == 0) and torch.all(w[:, :, 2] == 0)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_runs_in_float32(dtype):
    q, k, v = qkv(dtype=torch.float32)
    out = attention(q.to(dtype), k.to(dtype), v.to(dtype), TableBias(3), causal=True)
    assert out.dtype == dtype
    ref = attention(q, k, v, TableBias(3).float(), causal=True)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_gradients_flow_to_scheme_parameters():
    q, k, v = qkv()
    s = ScoreScheme(8)
    attention(q, k, v, s, causal=True).square().sum().backward()
    assert s.ak.grad is not None and s.ak.grad.abs().sum() > 0
    assert s.av.grad is not None and s.av.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- properties


@given(
    n=st.integers(2, 7),
    d=st.integers(1, 6),
    seed=st.integers(0, 10_000),
)
def test_nope_is_permutation_equivariant(n, d, seed):
    """Without position information, permuting the tokens permutes the outputs."""
    q, k, v = (rand(1, 2, n, d, seed=seed + i) for i in range(3))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    out = attention(q, k, v)
    out_p = attention(q[:, :, perm], k[:, :, perm], v[:, :, perm])
    torch.testing.assert_close(out_p, out[:, :, perm])


@given(n=st.integers(3, 7), seed=st.integers(0, 10_000))
def test_position_bias_breaks_equivariance(n, seed):
    q, k, v = (rand(1, 2, n, 4, seed=seed + i) for i in range(3))
    perm = torch.roll(torch.arange(n), 1)  # a permutation with no fixed point
    scheme = TableBias(2)
    with torch.no_grad():
        scheme.table.mul_(5)
    out = attention(q, k, v, scheme)
    out_p = attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], scheme)
    assert not torch.allclose(out_p, out[:, :, perm], atol=1e-6)


def test_hooks_introspection():
    assert HOOKS == ("embed", "rotate", "bias", "score")
    assert NoPE().hooks() == ()
    assert TableBias(2).hooks() == ("bias",)
    assert ScoreScheme(4).hooks() == ("score",)
    assert Negate().hooks() == ("rotate",)
    assert TableBias.hooks() == ("bias",)  # also on the class
    assert "hooks=('bias',)" in repr(TableBias(2))


def test_scheme_is_not_callable_as_a_layer():
    with pytest.raises(TypeError, match="position scheme, not a layer"):
        NoPE()(torch.zeros(1))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((2, 3, 5, 8), (1, 3, 5, 8), (1, 3, 5, 8)), "k batch size 1 must equal q batch size 2"),
        (((2, 3, 5, 8), (2, 3, 5, 4), (2, 3, 5, 4)), "k head_dim 4 must equal q head_dim 8"),
        (((2, 3, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)), r"q heads \(3\) must be a multiple of k heads \(2\)"),
        (((2, 3, 5, 8), (2, 3, 5, 8), (2, 3, 4, 8)), "v shape"),
        (((3, 5, 8), (2, 3, 5, 8), (2, 3, 5, 8)), "q must have 4 dimensions"),
    ],
)
def test_shape_errors(shapes, message):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        attention(q, k, v)


def test_position_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q_pos must have shape \(5,\) or \(2, 5\), got \(4,\)"):
        attention(q, k, v, q_pos=torch.arange(4))
    with pytest.raises(ValueError, match=r"k_pos must have shape \(5,\) or \(2, 5\), got \(3, 5\)"):
        attention(q, k, v, k_pos=torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="q_pos must hold integers"):
        attention(q, k, v, q_pos=torch.arange(5.0))
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        attention([[1.0]], k, v)


def test_other_argument_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="must share a floating dtype"):
        attention(q.float(), k, v)
    with pytest.raises(TypeError, match="scheme must be a companion PositionScheme"):
        attention(q, k, v, scheme=torch.nn.Identity())
    with pytest.raises(ValueError, match="attn_mask shape"):
        attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool))

    class BadBias(PositionScheme):
        def bias(self, q_pos, k_pos):
            return torch.zeros(7, 7)

    with pytest.raises(ValueError, match=r"BadBias.bias returned shape \(7, 7\)"):
        attention(q, k, v, BadBias())

    class BadRotate(PositionScheme):
        def rotate(self, q, k, q_pos, k_pos):
            return q[..., :4], k

    with pytest.raises(ValueError, match="BadRotate.rotate must preserve the shapes"):
        attention(q, k, v, BadRotate())
