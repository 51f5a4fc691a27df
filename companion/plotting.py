"""The book's shared matplotlib style.

Call :func:`use_book_style` once at the top of a notebook. Figures are sized for the book's
text width, with labelled axes, a light grid, and one colour per family of schemes so that a
reader can follow, say, RoPE across chapters by its colour.
"""

from __future__ import annotations

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
    """Apply the book's rcParams (idempotent)."""
    import matplotlib as mpl

    mpl.rcParams.update(_STYLE)
    from cycler import cycler

    order = ["rope", "sinusoidal", "alibi", "t5", "shaw", "learned", "nope", "reference"]
    mpl.rcParams["axes.prop_cycle"] = cycler(color=[SCHEME_COLORS[k] for k in order])


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
