"""The book's shared matplotlib style.

Call :func:`use_book_style` once at the top of a notebook. Figures are sized for the book's
text width, with labelled axes, a light grid, and one colour per family of schemes so that a
reader can follow, say, RoPE across chapters by its colour.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["SCHEME_COLORS", "SCHEME_MARKERS", "METHOD_STYLES", "use_book_style", "scheme_color", "scheme_marker",
           "scheme_style", "method_style"]

#: One colour per family (colour-blind-safe, after Okabe and Ito).
SCHEME_COLORS: dict[str, str] = {
    "nope": "#7f7f7f",
    "sinusoidal": "#0072B2",
    "learned": "#56B4E9",
    "shaw": "#009E73",
    "xl": "#999933",
    "t5": "#E69F00",
    "rope": "#D55E00",
    "alibi": "#CC79A7",
    "xpos": "#882255",
    "p-rope": "#AA4499",
    "p-rope-0.375": "#E8A5DA",
    "alibi-learned": "#8C2D6E",
    "kerple-log": "#117733",
    "kerple-power": "#44AA99",
    "fire": "#332288",
    "cope": "#DDCC77",
    "rope-nope": "#E31A1C",
    "rope-window-nope": "#FB9A99",
    "rope-local-global": "#1F78B4",
    "irope": "#33A02C",
    "irope-temp": "#B2DF8A",
    "scaling": "#F0E442",
    "sincos-2d": "#0072B2",
    "learned-2d": "#56B4E9",
    "axial": "#D55E00",
    "mixed": "#6A3D9A",
    "m-rope": "#B15928",
    "reference": "#000000",
}

#: One marker per scheme of chapter 8's comparison (every other scheme gets a circle), so
#: that curves stay apart in print and for readers who do not see the colours.
SCHEME_MARKERS: dict[str, str] = {
    "nope": "o",
    "sinusoidal": "v",
    "learned": "^",
    "shaw": "s",
    "xl": "D",
    "t5": "P",
    "rope": "X",
    "alibi": "*",
    "p-rope": "<",
    "p-rope-0.375": ">",
    "alibi-learned": "h",
    "kerple-log": "p",
    "kerple-power": "d",
    "rope-nope": "H",
    "rope-window-nope": "8",
    "rope-local-global": "+",
    "irope": "x",
    "irope-temp": "1",
}

#: One style per RoPE scaling method (chapters 9, 10 and 13) and training-free method (chapters 10
#: and 11): colour, marker and line style. A control drawn beside its method shares the method's
#: colour with a dashed line ("NTK at s^2 - s + 1" beside NTK-aware, YaRN without its temperature
#: beside YaRN). "none" is plain RoPE, drawn in grey so that it reads as the baseline.
METHOD_STYLES: dict[str, dict[str, str]] = {
    "none": {"color": "#555555", "marker": "o", "linestyle": "-"},
    "pi": {"color": "#0072B2", "marker": "s", "linestyle": "-"},
    "ntk": {"color": "#E69F00", "marker": "^", "linestyle": "-"},
    "ntk-matched": {"color": "#E69F00", "marker": "v", "linestyle": "--"},
    "dynamic": {"color": "#CC6677", "marker": "D", "linestyle": "-"},
    "yarn": {"color": "#009E73", "marker": "P", "linestyle": "-"},
    "yarn-no-temp": {"color": "#009E73", "marker": "X", "linestyle": "--"},
    "llama3": {"color": "#CC79A7", "marker": "*", "linestyle": "-"},
    "longrope": {"color": "#56B4E9", "marker": "h", "linestyle": "-"},
    "abf": {"color": "#882255", "marker": "p", "linestyle": "-"},
    "log-n": {"color": "#AA3377", "marker": "x", "linestyle": "-."},
    "llama4": {"color": "#EE7733", "marker": "+", "linestyle": "-."},
    "rerope": {"color": "#6699CC", "marker": "<", "linestyle": "-"},
    "leaky_rerope": {"color": "#004488", "marker": ">", "linestyle": "-"},
    "self_extend": {"color": "#997700", "marker": "d", "linestyle": "-"},
    "sinks": {"color": "#994455", "marker": "H", "linestyle": "-"},
    "window_only": {"color": "#EE99AA", "marker": "8", "linestyle": "-"},
    "sinks_no_rerotate": {"color": "#994455", "marker": "1", "linestyle": "--"},
}

_STYLE: dict[str, Any] = {
    "figure.figsize": (7.0, 3.6),
    "figure.dpi": 100,
    "savefig.dpi": 150,
    "savefig.bbox": "tight",
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.frameon": False,
    "lines.linewidth": 1.8,
    "image.cmap": "viridis",
    "figure.constrained_layout.use": True,
    "svg.hashsalt": "companion",
}


def use_book_style() -> None:
    """Apply the book's rcParams (idempotent) and, inside an IPython kernel, record the legend
    styles of every figure it displays (``record_figure_styles``)."""
    import matplotlib as mpl

    mpl.rcParams.update(_STYLE)
    from cycler import cycler

    order = ["rope", "sinusoidal", "alibi", "t5", "shaw", "learned", "nope", "reference"]
    mpl.rcParams["axes.prop_cycle"] = cycler(color=[SCHEME_COLORS[k] for k in order])
    record_figure_styles()


def scheme_color(name: str) -> str:
    """The colour of a scheme family, e.g. ``scheme_color("rope")``."""
    key = name.lower()
    if key not in SCHEME_COLORS:
        raise ValueError(f"unknown scheme family {name!r}; known: {sorted(SCHEME_COLORS)}")
    return SCHEME_COLORS[key]


def scheme_marker(name: str) -> str:
    """The marker of a scheme (``"o"`` for one without its own), e.g. ``scheme_marker("xl")``."""
    scheme_color(name)  # the same unknown-name error
    return SCHEME_MARKERS.get(name.lower(), "o")


def scheme_style(name: str) -> dict[str, str]:
    """``{"color": ..., "marker": ...}`` of a scheme, for ``ax.plot(..., **scheme_style(s))``."""
    return {"color": scheme_color(name), "marker": scheme_marker(name)}


def method_style(name: str) -> dict[str, str]:
    """``{"color", "marker", "linestyle"}`` of a scaling or training-free method (a key of
    :data:`METHOD_STYLES`, as :mod:`companion.lab.extend` and :mod:`companion.longctx` name them),
    for ``ax.plot(..., **method_style(m))``."""
    if not isinstance(name, str) or name.lower() not in METHOD_STYLES:
        raise ValueError(f"unknown method {name!r}; known: {sorted(METHOD_STYLES)}")
    return dict(METHOD_STYLES[name.lower()])


#: How figures name each scheme (a key of :data:`SCHEME_COLORS`) and method (a key of
#: :data:`METHOD_STYLES`) in their legends, as case-insensitive phrases. A legend label that
#: names exactly one of them must be drawn in its colour (:func:`named_style_keys`, checked by
#: ``tests/test_presentation.py`` on the styles :func:`record_figure_styles` stores with every
#: figure). Each key is also matched as written, with ``-`` or ``_`` read as either, except the
#: keys that are common words ("none", "mixed", "scaling"), which only their phrases name.
STYLE_ALIASES: dict[str, tuple[str, ...]] = {
    "none": ("plain RoPE", "no scaling"),
    "mixed": ("RoPE-Mixed", "mixed 2-D RoPE"),
    "xl": ("Transformer-XL",),
    "t5": ("T5 bias", "T5 buckets"),
    "alibi-learned": ("learned ALiBi", "learned slopes"),
    "kerple-log": ("Kerple (log)", "Kerple log"),
    "kerple-power": ("Kerple (power)", "Kerple power"),
    "rope-nope": ("RoPE + NoPE", "RoPE/NoPE"),
    "rope-window-nope": ("windowed RoPE + global NoPE", "windowed RoPE"),
    "rope-local-global": ("local RoPE + global RoPE 1e6", "local RoPE + global RoPE"),
    "irope": ("chunked RoPE + global NoPE", "iRoPE"),
    "irope-temp": ("chunked RoPE + global NoPE, temperature", "iRoPE with temperature"),
    "p-rope-0.375": ("p-RoPE (p = 3/8)",),
    "sincos-2d": ("2-D sin-cos", "2-D sinusoidal"),
    "learned-2d": ("2-D learned",),
    "pi": ("position interpolation",),
    "ntk": ("NTK-aware",),
    "dynamic": ("Dynamic NTK",),
    "llama3": ("Llama 3 scaling",),
    "log-n": ("log-n scaling",),
    "llama4": ("Llama 4's temperature", "Llama 4 temperature"),
    "leaky_rerope": ("Leaky ReRoPE",),
    "self_extend": ("Self-Extend",),
    "sinks": ("attention sinks",),
}

#: The key of a figure's output metadata (under its image MIME type) that holds the styles
#: :func:`record_figure_styles` records.
FIGURE_STYLES_KEY = "companion_figure_styles"


@functools.lru_cache(maxsize=1)
def _alias_patterns() -> list[tuple[str, Any]]:
    import re

    def phrase(text: str) -> str:
        words = re.split(r"[-_ ]", text)
        return r"[-_ ]".join(re.escape(w) for w in words)

    pairs = []
    for key in [*SCHEME_COLORS, *METHOD_STYLES]:
        bare = () if key in ("none", "mixed", "scaling") else (key,)
        for text in (*bare, *STYLE_ALIASES.get(key, ())):
            # a name is a whole word: no letter, digit, hyphen or underscore on either side
            pairs.append((key, re.compile(rf"(?<![\w-]){phrase(text)}(?![\w-])", re.I)))
    return pairs


def named_style_keys(label: str) -> list[str]:
    """The schemes and methods a legend label names, as keys of :data:`SCHEME_COLORS` or
    :data:`METHOD_STYLES`, in the order they first appear.

    A name inside a longer one does not count: ``"p-RoPE"`` names ``p-rope`` only, not ``rope``.

    Args:
        label: the legend label (a string; matplotlib's hidden labels start with ``_``).

    Returns:
        The keys named, possibly none.

    Raises:
        TypeError: if ``label`` is not a string.
    """
    if not isinstance(label, str):
        raise TypeError(f"label must be a string, got {type(label).__name__}")
    spans = []
    for key, pattern in _alias_patterns():
        for m in pattern.finditer(label):
            spans.append((m.start(), m.end(), key))
    # drop a match that lies inside a longer one ("ntk" inside "Dynamic NTK")
    kept = [s for s in spans if not any(o[0] <= s[0] and s[1] <= o[1] and (o[1] - o[0]) > (s[1] - s[0])
                                        for o in spans)]
    return list(dict.fromkeys(key for _, _, key in sorted(kept)))


def style_key_colour(key: str) -> str:
    """The map's colour of a scheme or method key (lower-case hex), e.g. ``"rope"`` or ``"yarn"``.

    Raises:
        ValueError: if ``key`` is neither a scheme nor a method.
    """
    if isinstance(key, str) and key.lower() in SCHEME_COLORS:
        return SCHEME_COLORS[key.lower()].lower()
    if isinstance(key, str) and key.lower() in METHOD_STYLES:
        return METHOD_STYLES[key.lower()]["color"].lower()
    raise ValueError(f"unknown scheme or method {key!r}; known: {sorted([*SCHEME_COLORS, *METHOD_STYLES])}")


def _artist_style(handle: Any) -> dict[str, str] | None:
    from matplotlib.collections import Collection
    from matplotlib.colors import to_hex
    from matplotlib.container import Container
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if isinstance(handle, Container):  # a bar or error-bar container: its first drawn part
        parts = [c for c in handle.get_children() if isinstance(c, (Line2D, Collection, Patch))]
        if not parts:
            return None
        handle = parts[0]
    if isinstance(handle, Line2D):
        return {"color": to_hex(handle.get_color()), "marker": str(handle.get_marker()),
                "linestyle": str(handle.get_linestyle())}
    if isinstance(handle, (Collection, Patch)):
        faces = handle.get_facecolor()
        faces = [faces] if isinstance(handle, Patch) else list(faces)
        if not faces or all(len(f) == 4 and f[3] == 0 for f in faces):  # unfilled: its edge
            edges = handle.get_edgecolor()
            faces = [edges] if isinstance(handle, Patch) else list(edges)
        if not faces:
            return None
        return {"color": to_hex(faces[0]), "marker": "", "linestyle": ""}
    return None


def figure_styles(fig: Any) -> list[dict[str, str]]:
    """Label and style of every artist that a legend of ``fig`` can name: the labelled artists
    of each axes (what ``ax.legend()`` would list) and the entries of figure-level legends.

    Args:
        fig: a :class:`matplotlib.figure.Figure`.

    Returns:
        One ``{"label", "color", "marker", "linestyle"}`` per distinct entry, colours as
        lower-case ``#rrggbb``.

    Raises:
        TypeError: if ``fig`` is not a matplotlib figure.
    """
    from matplotlib.figure import Figure

    if not isinstance(fig, Figure):
        raise TypeError(f"fig must be a matplotlib Figure, got {type(fig).__name__}")
    entries = []
    for ax in fig.axes:
        entries += zip(*ax.get_legend_handles_labels())
    for legend in fig.legends:
        entries += zip(legend.legend_handles, (t.get_text() for t in legend.get_texts()))
    records = []
    for handle, label in entries:
        style = _artist_style(handle)
        if style is not None and label and not label.startswith("_"):
            record = {"label": label, **style}
            if record not in records:
                records.append(record)
    return records


def _wrap_figure_printers(shell: Any) -> None:
    """Make the shell's image formatters for figures return :func:`figure_styles` as metadata."""
    from matplotlib.figure import Figure

    for mime in ("image/png", "image/svg+xml", "image/jpeg"):
        formatter = shell.display_formatter.formatters.get(mime)
        if formatter is None:
            continue
        try:
            printer = formatter.lookup_by_type(Figure)
        except KeyError:  # this format is not enabled (yet)
            continue
        if getattr(printer, "_records_styles", False):
            continue

        def recording(fig, _printer=printer):
            data = _printer(fig)
            return None if data is None else (data, {FIGURE_STYLES_KEY: figure_styles(fig)})

        recording._records_styles = True
        formatter.for_type(Figure, recording)


def record_figure_styles() -> None:
    """Store :func:`figure_styles` with every figure this IPython kernel displays, in the
    output's metadata under :data:`FIGURE_STYLES_KEY`, so that the book's test can check every
    stored figure's colours against the map without re-running the notebook.

    Call it once, in a notebook's first cell. It makes pyplot load its backend, so that the
    inline backend installs its image formatters, wraps them, and wraps them again before every
    later cell in case the backend installed them anew. Outside IPython it does nothing;
    calling it again changes nothing.
    """
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is there wherever notebooks run
        return
    shell = get_ipython()
    if shell is None:
        return
    import matplotlib.pyplot as plt

    plt.close(plt.figure())  # pyplot loads its backend, and the inline backend its formatters, lazily
    _wrap_figure_printers(shell)
    if not getattr(shell, "_companion_records_styles", False):
        shell.events.register("pre_run_cell", lambda *args: _wrap_figure_printers(shell))
        shell._companion_records_styles = True


__all__ += ["STYLE_ALIASES", "FIGURE_STYLES_KEY", "named_style_keys", "style_key_colour", "figure_styles",
            "record_figure_styles"]
