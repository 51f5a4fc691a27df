"""The tiny model, the attention layer, seeding, provenance and the plot style."""

import json
import math

import pytest
import torch

from companion import MultiHeadAttention, NoPE, TinyDecoder, load_result, provenance, save_result, seed_everything
from companion.utils import peak_tensor_bytes
from companion.plotting import SCHEME_COLORS, SCHEME_MARKERS, scheme_color, scheme_marker, scheme_style, use_book_style


def test_decoder_is_causal():
    seed_everything(0)
    model = TinyDecoder(vocab_size=11, d_model=16, n_heads=2, n_layers=2).eval()
    idx = torch.randint(0, 11, (2, 9))
    changed = idx.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 11
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_decoder_learns_a_copy_task():
    seed_everything(0)
    model = TinyDecoder(vocab_size=8, d_model=32, n_heads=2, n_layers=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 8, (16, 12))
    first = None
    for _ in range(60):
        loss = model.loss(idx[:, :-1], idx[:, 1:])
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_decoder_ties_weights_and_rejects_bad_ids():
    model = TinyDecoder(vocab_size=5, d_model=8, n_heads=2, n_layers=1)
    assert model.head.weight is model.tok.weight
    assert isinstance(model.scheme, NoPE)
    with pytest.raises(IndexError, match=r"idx must lie in \[0, 5\), got \[0, 5\]"):
        model(torch.tensor([[0, 5]]))
    with pytest.raises(TypeError, match="integer token ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="position_ids must have shape"):
        model(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.arange(4))


def test_attention_layer_shapes_and_errors():
    layer = MultiHeadAttention(12, 3, n_kv_heads=1)
    x = torch.randn(2, 4, 12)
    out, w = layer(x, causal=True, return_weights=True)
    assert out.shape == (2, 4, 12) and w.shape == (2, 3, 4, 4)
    assert torch.all(w.triu(1) == 0)
    with pytest.raises(ValueError, match=r"d_model \(10\) must be a multiple of n_heads \(3\)"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"):
        MultiHeadAttention(8, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_heads must be >= 1"):
        MultiHeadAttention(8, 0)
    with pytest.raises(ValueError, match="x must have 3 dimensions"):
        layer(torch.randn(4, 12))


def test_seed_everything_reproduces():
    seed_everything(123)
    a = torch.randn(3)
    g = seed_everything(123)
    assert torch.equal(a, torch.randn(3))
    assert torch.equal(torch.randn(2, generator=g), torch.randn(2, generator=torch.Generator().manual_seed(123)))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="seed must be a non-negative int"):
            seed_everything(bad)


def test_result_files_carry_provenance(tmp_path):
    path = save_result(tmp_path / "sub" / "r.json", {"x": [1, 2]}, command="python -m x")
    payload = load_result(path)
    assert payload["data"] == {"x": [1, 2]}
    prov = payload["provenance"]
    assert prov["command"] == "python -m x"
    assert prov["torch"] == torch.__version__
    for key in ("git_commit", "date_utc", "python", "machine", "cpu_count"):
        assert key in prov
    assert provenance()["command"] is None
    (tmp_path / "bad.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(ValueError, match="is not a result file"):
        load_result(tmp_path / "bad.json")


def test_result_files_keep_arrays_on_one_line(tmp_path):
    data = {"runs": [{"blocks": [1.5, 2.25, 3.0], "grid": [[0, 1], [1, 0]], "empty": {}, "name": "a"}],
            "nan": [float("nan"), float("inf")], "nested": {"k": [{"x": 1}]}}
    path = save_result(tmp_path / "r.json", data)
    text = path.read_text()
    # a list of numbers, or of lists of numbers, is one line; records stay one key per line
    assert '"blocks": [1.5, 2.25, 3.0]' in text and '"grid": [[0, 1], [1, 0]]' in text
    assert '\n        "name": "a"' in text
    back = load_result(path)["data"]
    assert back["runs"] == data["runs"] and back["nested"] == data["nested"]
    assert math.isnan(back["nan"][0]) and back["nan"][1] == float("inf")


def test_book_style():
    import matplotlib as mpl

    use_book_style()
    assert mpl.rcParams["axes.grid"] is True
    assert scheme_color("RoPE") == SCHEME_COLORS["rope"]
    with pytest.raises(ValueError, match="unknown scheme family 'xyz'"):
        scheme_color("xyz")


def test_chapter_8_schemes_have_distinct_colours_and_markers():
    schemes = ["nope", "sinusoidal", "learned", "shaw", "xl", "t5", "rope", "alibi"]
    assert len({scheme_color(s) for s in schemes}) == len(schemes)
    assert len({scheme_marker(s) for s in schemes}) == len(schemes)
    assert scheme_style("XL") == {"color": SCHEME_COLORS["xl"], "marker": SCHEME_MARKERS["xl"]}
    assert scheme_marker("fire") == "o"  # a scheme without a marker of its own
    with pytest.raises(ValueError, match="unknown scheme family 'xyz'"):
        scheme_marker("xyz")


def test_chapter_11_comparisons_have_distinct_colours_and_markers():
    # the pairs chapter 11 sets side by side: each scheme against its control
    for group in (["rope", "p-rope", "p-rope-0.375"], ["alibi", "alibi-learned", "kerple-log", "kerple-power"],
                  ["rope", "rope-nope", "rope-window-nope", "nope"]):
        assert len({scheme_color(s) for s in group}) == len(group), group
        assert len({scheme_marker(s) for s in group}) == len(group), group
    assert len(set(SCHEME_MARKERS.values())) == len(SCHEME_MARKERS)  # no marker serves two schemes


def test_method_styles_are_distinct_and_controls_share_their_methods_colour():
    from companion.lab.extend import METHODS
    from companion.lab.trainfree_lab import LAB_TRAINFREE
    from companion.plotting import METHOD_STYLES, method_style
    assert set(METHODS) <= set(METHOD_STYLES) and set(LAB_TRAINFREE) <= set(METHOD_STYLES)
    looks = {(v["color"], v["marker"], v["linestyle"]) for v in METHOD_STYLES.values()}
    assert len(looks) == len(METHOD_STYLES)                          # no two methods drawn alike
    assert len({v["marker"] for v in METHOD_STYLES.values()}) == len(METHOD_STYLES)  # grey-scale print
    for control, method in (("ntk-matched", "ntk"), ("yarn-no-temp", "yarn"), ("sinks_no_rerotate", "sinks")):
        assert method_style(control)["color"] == method_style(method)["color"]
        assert method_style(control)["linestyle"] != method_style(method)["linestyle"]
    solid = [k for k, v in METHOD_STYLES.items() if v["linestyle"] == "-"]
    assert len({METHOD_STYLES[k]["color"] for k in solid}) == len(solid)  # methods drawn solid differ in colour
    with pytest.raises(ValueError, match="unknown method 'xyz'"):
        method_style("xyz")


def test_peak_tensor_bytes_counts_live_storages():
    x = torch.zeros(1000)

    def work():
        a = torch.ones(1000)  # 4000 bytes
        b = torch.ones(2000)  # + 8000 = 12000 alive together
        del a, b
        c = torch.ones(500)  # both freed: the peak stays 12000
        return x.view(10, 100).t() + 0 + c.sum()  # a view of an input costs nothing

    peak, out = peak_tensor_bytes(work)
    assert out.shape == (100, 10)
    assert peak == 12000
    peak_view, _ = peak_tensor_bytes(lambda: x.view(10, 100).t())
    assert peak_view == 0


# ----------------------------------------------------------------------------- NoPE layers

def test_nope_every_follows_the_llama4_pattern():
    from companion.model import nope_every
    # Llama 4 / SmolLM3: no_rope_layers[i] = int((i + 1) % 4 != 0), 1 = RoPE
    no_rope_layers = [int((i + 1) % 4 != 0) for i in range(12)]
    assert nope_every(12, 4) == tuple(i for i, r in enumerate(no_rope_layers) if not r) == (3, 7, 11)
    assert nope_every(3, 4) == ()
    assert nope_every(2, 1) == (0, 1)
    with pytest.raises(ValueError, match="interval"):
        nope_every(4, 0)


@pytest.mark.parametrize("scheme_name", ["rope", "alibi"])
def test_nope_layers_drop_the_scheme_in_those_layers_only(scheme_name):
    from companion import ALiBi, RotaryEmbedding
    make = {"rope": lambda: RotaryEmbedding(8), "alibi": lambda: ALiBi(4)}[scheme_name]
    x = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    hybrid = TinyDecoder(40, 32, 4, 3, scheme=make(), nope_layers=(1,)).double()
    assert [type(b.attn.scheme).__name__ for b in hybrid.blocks] == [
        type(make()).__name__, "NoPE", type(make()).__name__]
    # The fast path shares masks and biases between layers: a NoPE layer must not pick up the
    # scheme's bias. The reference path builds everything per call.
    ref = TinyDecoder(40, 32, 4, 3, scheme=make(), nope_layers=(1,), attention_impl="reference").double()
    ref.load_state_dict(hybrid.state_dict())
    torch.testing.assert_close(hybrid(x), ref(x), rtol=0, atol=1e-12)
    # and the hybrid differs from the all-scheme model with the same weights (layer 1 changed)
    full = TinyDecoder(40, 32, 4, 3, scheme=make()).double()
    full.load_state_dict(hybrid.state_dict())
    assert (full(x) - hybrid(x)).abs().max() > 1e-6
    # every layer NoPE is the NoPE model
    none = TinyDecoder(40, 32, 4, 3, scheme=make(), nope_layers=(0, 1, 2)).double()
    nope = TinyDecoder(40, 32, 4, 3, scheme=None).double()
    nope.load_state_dict(none.state_dict(), strict=False)
    torch.testing.assert_close(none(x), nope(x), rtol=0, atol=0)


@pytest.mark.parametrize("bad, exc, pattern", [
    ((3,), IndexError, r"nope_layers entries must lie in \[0, 3\)"),
    ((-1,), IndexError, r"nope_layers entries must lie in \[0, 3\)"),
    ((1, 1), ValueError, "must not repeat"),
    ("1", TypeError, "sequence of layer indices"),
    ((1.0,), TypeError, "must hold ints"),
])
def test_nope_layers_validation(bad, exc, pattern):
    with pytest.raises(exc, match=pattern):
        TinyDecoder(40, 32, 4, 3, nope_layers=bad)


def test_named_style_keys_finds_whole_names_only():
    from companion.plotting import named_style_keys

    assert named_style_keys("RoPE") == ["rope"]
    assert named_style_keys("p-RoPE, keep 0.75") == ["p-rope"]  # not also "rope"
    assert named_style_keys("Dynamic NTK") == ["dynamic"]  # not also "ntk"
    # chapter 11's controls: each label names its own scheme, not the one inside it
    assert named_style_keys("p-RoPE (p = 3/8)") == ["p-rope-0.375"]
    assert named_style_keys("p-RoPE (p = 3/4)") == ["p-rope"]
    assert named_style_keys("windowed RoPE + global NoPE") == ["rope-window-nope"]
    assert named_style_keys("NTK-aware, s = 4") == ["ntk"]
    assert named_style_keys("T5, max_distance 32") == ["t5"]
    assert named_style_keys("Transformer-XL") == ["xl"]
    assert named_style_keys("RoPE vs ALiBi") == ["rope", "alibi"]
    assert named_style_keys("plain RoPE") == ["none"]  # the baseline of the scaling methods
    assert named_style_keys("yarn_no_temp") == ["yarn-no-temp"]  # "-" and "_" read as either
    for unnamed in ("head 3", "pair i", "mixed precision", "none of them", "a CIFAR image", "d = 128"):
        assert named_style_keys(unnamed) == [], unnamed
    with pytest.raises(TypeError, match="label must be a string"):
        named_style_keys(3)


def test_every_alias_names_a_key_of_the_map():
    from companion.plotting import METHOD_STYLES, SCHEME_COLORS, STYLE_ALIASES, named_style_keys, style_key_colour

    assert set(STYLE_ALIASES) <= set(SCHEME_COLORS) | set(METHOD_STYLES)
    assert not set(SCHEME_COLORS) & set(METHOD_STYLES)  # a key names one thing
    for key, phrases in STYLE_ALIASES.items():
        for phrase in phrases:
            assert named_style_keys(phrase) == [key], phrase
    assert style_key_colour("RoPE") == SCHEME_COLORS["rope"].lower()
    assert style_key_colour("yarn") == METHOD_STYLES["yarn"]["color"].lower()
    with pytest.raises(ValueError, match="unknown scheme or method 'xyz'"):
        style_key_colour("xyz")


def test_figure_styles_reads_what_matplotlib_draws():
    """Lines, scatters, bars and figure-level legends, in the colours matplotlib draws them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from companion.plotting import figure_styles, scheme_style

    fig, (a, b) = plt.subplots(1, 2)
    a.plot([0, 1], [0, 1], label="RoPE", **scheme_style("rope"))
    a.plot([0, 1], [1, 0], "C1--", label="ALiBi")
    a.plot([0, 1], [0, 0], label="_hidden")
    b.scatter([0, 1], [0, 1], color="#123456", label="T5")
    b.bar([0, 1], [1, 2], color="#abcdef", label="Shaw")
    line = b.plot([0, 1], [2, 2], color="k")[0]
    fig.legend([line], ["reference"])
    styles = figure_styles(fig)
    plt.close(fig)
    assert {r["label"]: r["color"] for r in styles} == {
        "RoPE": "#d55e00", "ALiBi": to_hex("C1"), "T5": "#123456", "Shaw": "#abcdef", "reference": "#000000"}
    assert {r["label"]: (r["marker"], r["linestyle"]) for r in styles}["RoPE"] == ("X", "-")
    with pytest.raises(TypeError, match="fig must be a matplotlib Figure"):
        figure_styles("not a figure")


def test_record_figure_styles_puts_the_styles_in_the_display_metadata():
    """In an IPython shell with an image formatter for figures, displaying a figure returns
    its styles as metadata; outside IPython the call does nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.core.pylabtools import select_figure_formats

    from companion.plotting import FIGURE_STYLES_KEY, record_figure_styles, scheme_color

    assert record_figure_styles() is None  # no shell: nothing happens
    shell = InteractiveShell.instance()
    try:
        select_figure_formats(shell, {"png"})
        record_figure_styles()
        record_figure_styles()  # idempotent
        fig, ax = plt.subplots()
        ax.plot([0, 1], [0, 1], color=scheme_color("alibi"), label="ALiBi")
        data, metadata = shell.display_formatter.format(fig)
        plt.close(fig)
        assert "image/png" in data
        assert metadata["image/png"][FIGURE_STYLES_KEY] == [
            {"label": "ALiBi", "color": "#cc79a7", "marker": "None", "linestyle": "-"}]
    finally:
        InteractiveShell.clear_instance()
