"""Interactive figures for the static site: every state computed here, switched in the browser.

Each builder below computes, with the package's own functions, every state its controls can
reach (a base, a head dimension, a factor, a head), and returns an :class:`InteractiveFigure`.
Its HTML is one self-contained block: the controls (native ``<input type="range">`` and
``<select>`` elements), a static PNG of the default state, the states as JSON, and a short
script that, when `Plotly.js <https://plotly.com/javascript/>`_ is on the page, replaces the
PNG by a Plotly chart and redraws it from the stored state whenever a control moves. The
browser computes nothing: it looks a state up by its key. Without JavaScript, or in a notebook
viewer without Plotly, the static PNG stays and the controls stay hidden.

The book's site serves Plotly.js itself (copied from the npm registry at build time, as
MathJax is) and loads it once on the pages that hold such a figure (``book/_ext``); no page
asks a CDN for anything. The figures' traces and layouts are plain dicts in Plotly's figure
schema (``tests/test_interactive.py`` validates them with the pinned ``plotly`` package), so
this module needs neither ``plotly`` nor a browser.

Weight: numeric arrays are rounded to 4 significant digits and stored once per figure (a
trace that reuses the x values of another refers to them), so a figure with a few hundred
states stays well under the book's budget of 1 MB of HTML per figure
(:data:`MAX_FIGURE_BYTES`, checked on the stored notebooks).

The four figures of the book:

* :func:`rope_clock`: each pair's wavelength against the training length (chapter 5);
* :func:`score_distance`: RoPE's score against distance, similar and unrelated keys, and
  RoFormer's bound (chapter 5);
* :func:`scaling_methods`: per-pair slow-down of every context-extension method on real model
  configs (chapter 9);
* :func:`position_biases`: ALiBi, T5, Kerple and FIRE as bias matrices and distance curves
  (chapter 11).
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._checks import check_positive_int
from .alibi import alibi_slopes
from .learned_bias import FIRE, KerpleBias
from .plotting import METHOD_STYLES, scheme_color
from .recipe import longest_context_of
from .relative import t5_relative_position_bucket
from .rope import apply_rope, rope_cos_sin, rope_frequencies
from .scaling import compute_inv_freq
from .utils import seed_everything

__all__ = [
    "MAX_FIGURE_BYTES",
    "PLOTLY_JS",
    "MODEL_CONFIGS",
    "Control",
    "InteractiveFigure",
    "rope_clock",
    "score_distance",
    "scaling_methods",
    "position_biases",
    "decay_bound",
]

#: The most bytes of HTML one interactive figure may add to its page (states, script and its
#: static PNG; the Plotly.js library itself loads once per page and is not counted).
MAX_FIGURE_BYTES = 1_000_000

#: Where the site serves Plotly.js, relative to the site root (``book/_ext`` adds it to the
#: pages that need it; ``make book`` copies it from the npm package pinned in
#: ``book/package.json``).
PLOTLY_JS = "plotly/plotly-cartesian.min.js"

_TWO_PI = 2 * math.pi
_SIGNIFICANT = 4
_SHARED_MIN = 8  # numeric lists at least this long are stored once and referred to


# ----------------------------------------------------------------------------- the figure


@dataclass(frozen=True)
class Control:
    """One control of an interactive figure.

    Attributes:
        name: the state-key field this control sets.
        label: what the page shows before it.
        values: the values it can take, in order (a slider steps through them).
        labels: how each value is shown (default: ``str(value)``).
        kind: ``"slider"`` (``<input type="range">``) or ``"select"``.
    """

    name: str
    label: str
    values: tuple
    labels: tuple = ()
    kind: str = "slider"

    def __post_init__(self) -> None:
        if self.kind not in ("slider", "select"):
            raise ValueError(f"kind must be 'slider' or 'select', got {self.kind!r}")
        if not self.values:
            raise ValueError(f"control {self.name!r}: values must not be empty")
        if len(set(self.values)) != len(self.values):
            raise ValueError(f"control {self.name!r}: values must be distinct, got {self.values!r}")
        if self.labels and len(self.labels) != len(self.values):
            raise ValueError(f"control {self.name!r}: {len(self.labels)} labels for {len(self.values)} values")
        if not self.labels:
            object.__setattr__(self, "labels", tuple(str(v) for v in self.values))

    def index(self, value: object) -> int:
        """The position of ``value`` in :attr:`values`; ``ValueError`` naming the choices."""
        try:
            return self.values.index(value)
        except ValueError:
            raise ValueError(f"{self.name} must be one of {list(self.values)}, got {value!r}") from None


@dataclass
class InteractiveFigure:
    """A figure whose every reachable state is precomputed.

    Attributes:
        figure_id: a page-unique id (letters, digits and ``-``).
        title: the figure's accessible name (the static image's alt text too).
        controls: the controls, in the order the page shows them.
        layout: the Plotly layout every state starts from.
        states: ``key -> {"data": [trace, ...], "layout": {...}, "readout": str}``, where
            ``key`` is a tuple of one value per control, in order. States missing for some
            keys are allowed (a head index past the head count); the page then moves the
            later sliders down to the nearest state that exists.
        default: the key shown first (and drawn in the static image).
    """

    figure_id: str
    title: str
    controls: list[Control]
    layout: dict
    states: dict[tuple, dict] = field(default_factory=dict)
    default: tuple = ()

    def __post_init__(self) -> None:
        if not self.figure_id or not all(ch.isalnum() or ch == "-" for ch in self.figure_id):
            raise ValueError(f"figure_id must be letters, digits and '-', got {self.figure_id!r}")
        names = [c.name for c in self.controls]
        if len(set(names)) != len(names):
            raise ValueError(f"control names must be distinct, got {names}")

    # -- states

    def add(self, key: Sequence, data: list[dict], readout: str, layout: Mapping | None = None) -> None:
        """Store the state for ``key`` (one value per control)."""
        key = tuple(key)
        if len(key) != len(self.controls):
            raise ValueError(f"a key has one value per control ({len(self.controls)}), got {key!r}")
        for control, value in zip(self.controls, key):
            control.index(value)
        self.states[key] = {"data": data, "layout": dict(layout or {}), "readout": readout}

    def with_default(self, key: Sequence) -> InteractiveFigure:
        """Set the state shown first (and drawn in the static image); returns the figure.

        Raises:
            ValueError: ``key`` does not give one value per control, a value is not one of
                its control's values, or the combination has no state.
        """
        if not isinstance(key, (tuple, list)) or len(key) != len(self.controls):
            raise ValueError(f"default must give one value per control {[c.name for c in self.controls]}, got {key!r}")
        for control, value in zip(self.controls, key):
            control.index(value)
        if tuple(key) not in self.states:
            raise ValueError(f"default {tuple(key)!r} has no state")
        self.default = tuple(key)
        return self

    def state(self, **values: object) -> dict:
        """The stored state for these control values (every control named).

        Raises:
            ValueError: a control is missing or unknown, or a value is not one of its values.
            KeyError: the combination has no state (for example a head past the head count).
        """
        names = [c.name for c in self.controls]
        if set(values) != set(names):
            raise ValueError(f"name every control exactly once: {names}, got {sorted(values)}")
        key = tuple(values[c.name] for c in self.controls)
        for control, value in zip(self.controls, key):
            control.index(value)
        if key not in self.states:
            raise KeyError(f"no state for {dict(zip(names, key))}")
        return self.states[key]

    # -- output

    def payload(self) -> dict:
        """The JSON the page holds: controls, base layout, and states keyed by the controls'
        indices joined with ``|``; numeric lists of at least 8 numbers are rounded to 4
        significant digits and stored once in ``arrays`` (``{"@": i}`` refers to one)."""
        if not self.states:
            raise ValueError(f"figure {self.figure_id!r} has no states")
        arrays: list[list] = []
        seen: dict[str, int] = {}

        def pack(obj: Any) -> Any:
            if isinstance(obj, np.ndarray):
                obj = obj.tolist()
            if isinstance(obj, torch.Tensor):
                obj = obj.tolist()
            if isinstance(obj, Mapping):
                return {k: pack(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                items = [pack(v) for v in obj]
                flat = all(v is None or isinstance(v, (int, float)) for v in items)
                if flat and len(items) >= _SHARED_MIN:
                    text = json.dumps(items, separators=(",", ":"))
                    if text not in seen:
                        seen[text] = len(arrays)
                        arrays.append(items)
                    return {"@": seen[text]}
                return items
            if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)):
                return obj
            if isinstance(obj, float):
                return _compact(obj)
            if isinstance(obj, (np.floating, np.integer)):
                return pack(obj.item())
            raise TypeError(f"cannot store a {type(obj).__name__} in a figure state")

        states = {}
        for key, st in self.states.items():
            index = "|".join(str(c.index(v)) for c, v in zip(self.controls, key))
            states[index] = {"data": pack(st["data"]), "layout": pack(st["layout"]), "readout": st["readout"]}
        default = self.default or next(iter(self.states))
        return {
            "controls": [{"name": c.name, "labels": list(c.labels), "kind": c.kind} for c in self.controls],
            "layout": pack(self.layout),
            "states": states,
            "arrays": arrays,
            "default": [c.index(v) for c, v in zip(self.controls, default)],
        }

    def static_png(self, dpi: int = 80) -> bytes:
        """The default state drawn with matplotlib (the page's fallback image)."""
        key = self.default or next(iter(self.states))
        return _draw_png(self.layout, self.states[key], self.title, dpi=dpi)

    def html(self, *, fallback: bool = True) -> str:
        """The figure as one HTML block (controls, fallback image, states, script)."""
        payload = json.dumps(self.payload(), separators=(",", ":"), allow_nan=False)
        payload = payload.replace("</", "<\\/")
        default = self.default or next(iter(self.states))
        fid = html.escape(self.figure_id)
        rows = []
        for control, value in zip(self.controls, default):
            i = control.index(value)
            label = html.escape(control.label)
            if control.kind == "slider":
                widget = (f'<input type="range" min="0" max="{len(control.values) - 1}" step="1" value="{i}" '
                          f'data-control="{html.escape(control.name)}" aria-label="{label}">'
                          f'<output>{html.escape(control.labels[i])}</output>')
            else:
                options = "".join(f'<option value="{j}"{" selected" if j == i else ""}>{html.escape(t)}</option>'
                                  for j, t in enumerate(control.labels))
                widget = f'<select data-control="{html.escape(control.name)}" aria-label="{label}">{options}</select>'
            rows.append(f'<label class="pe-control">{label} {widget}</label>')
        image = ""
        if fallback:
            png = base64.b64encode(self.static_png()).decode("ascii")
            image = (f'<img class="pe-fallback" alt="{html.escape(self.title)} (static image of the first state)" '
                     f'src="data:image/png;base64,{png}">')
        readout = html.escape(self.states[default]["readout"])
        return (
            f'<div class="pe-interactive" id="pe-{fid}" data-figure="{fid}">'
            f'<div class="pe-controls" hidden>{"".join(rows)}</div>'
            f'<div class="pe-plot">{image}</div>'
            f'<p class="pe-readout">{readout}</p>'
            f'<script type="application/json" class="pe-data">{payload}</script>'
            f"<script>{_SCRIPT.replace('@ID@', 'pe-' + fid)}</script>"
            "</div>"
        )

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        plain = f"interactive figure: {self.title} ({len(self.states)} states)"
        return {"text/html": self.html(), "text/plain": plain}


def _compact(value: float) -> float | None:
    """``value`` rounded to 4 significant digits (``None`` for NaN, a gap in a trace)."""
    if math.isnan(value):
        return None
    if math.isinf(value):
        raise ValueError("figure data must be finite (got an infinity)")
    return float(f"{value:.{_SIGNIFICANT}g}")


# The page script (one copy per figure, about 2 KB). It waits for the DOM (Plotly.js is loaded
# with ``defer``), does nothing without Plotly (the static image stays), and otherwise draws the
# default state and redraws on every input event. ``data-state`` on the figure's root holds the
# current key, for tests and for readers who inspect the page.
_SCRIPT = r"""(function () {
  var root = document.getElementById('@ID@');
  function start() {
    if (!window.Plotly || !root || root.dataset.ready) return;
    root.dataset.ready = '1';
    var spec = JSON.parse(root.querySelector('script.pe-data').textContent);
    function expand(o) {
      if (Array.isArray(o)) return o.map(expand);
      if (o && typeof o === 'object') {
        if (Object.keys(o).length === 1 && '@' in o) return spec.arrays[o['@']].slice();
        var out = {}; for (var k in o) out[k] = expand(o[k]); return out;
      }
      return o;
    }
    var inputs = Array.prototype.slice.call(root.querySelectorAll('[data-control]'));
    var plot = root.querySelector('.pe-plot');
    function key() { return inputs.map(function (el) { return el.value; }).join('|'); }
    function reachable(i) {
      var prefix = inputs.slice(0, i + 1).map(function (el) { return el.value; }).join('|');
      for (var k in spec.states) if (k === prefix || k.indexOf(prefix + '|') === 0) return true;
      return false;
    }
    function fit() {
      // Each control keeps its value if a state has it together with the controls before it;
      // otherwise it moves to the nearest lower value that has one (a head past the head
      // count, a method with no state for this model). Sliders stop at the last such value;
      // options without a state are disabled.
      inputs.forEach(function (el, i) {
        var saved = Number(el.value), ok = [];
        for (var v = 0; v < spec.controls[i].labels.length; v++) {
          el.value = String(v);
          if (reachable(i)) ok.push(v);
        }
        if (el.type === 'range') el.max = String(ok[ok.length - 1]);
        else Array.prototype.forEach.call(el.options, function (o) { o.disabled = ok.indexOf(Number(o.value)) < 0; });
        var lower = ok.filter(function (v) { return v <= saved; });
        el.value = String(lower.length ? lower[lower.length - 1] : ok[0]);
      });
    }
    function render() {
      fit();
      var k = key(), st = spec.states[k];
      if (!st) return;
      inputs.forEach(function (el, i) {
        var out = el.parentNode.querySelector('output');
        if (out) out.textContent = spec.controls[i].labels[Number(el.value)];
      });
      var layout = Object.assign({}, expand(spec.layout), expand(st.layout));
      plot.style.height = (layout.height || 400) + 'px';  // responsive charts fill their box
      Plotly.react(plot, expand(st.data), layout,
                   {displaylogo: false, responsive: true, modeBarButtonsToRemove: ['toImage', 'select2d', 'lasso2d']});
      root.querySelector('.pe-readout').textContent = st.readout;
      root.dataset.state = k;
    }
    inputs.forEach(function (el, i) { el.value = String(spec['default'][i]); el.addEventListener('input', render); });
    plot.innerHTML = '';
    root.querySelector('.pe-controls').hidden = false;
    render();
  }
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
  window.addEventListener('load', start);
})();"""


# ----------------------------------------------------------------------------- static image


def _axis_names(trace: Mapping) -> tuple[str, str]:
    return trace.get("xaxis", "x"), trace.get("yaxis", "y")


def _layout_axis(layout: Mapping, ref: str, letter: str) -> dict:
    suffix = ref[1:]
    return dict(layout.get(f"{letter}axis{suffix}", {}))


def _draw_png(base_layout: Mapping, state: Mapping, title: str, *, dpi: int) -> bytes:
    """Draw one state's traces (scatter lines and markers, heatmaps) with matplotlib."""
    from matplotlib.figure import Figure

    layout = {**base_layout, **state["layout"]}
    panels: list[tuple[str, str]] = []
    for trace in state["data"]:
        axes = _axis_names(trace)
        if axes not in panels:
            panels.append(axes)
    width = 8.0 if len(panels) > 1 else 7.0
    fig = Figure(figsize=(width, 3.4), dpi=dpi, layout="constrained")
    axs = fig.subplots(1, len(panels), squeeze=False)[0]
    where = {p: ax for p, ax in zip(panels, axs)}
    for trace in state["data"]:
        ax = where[_axis_names(trace)]
        if trace.get("visible") == "legendonly":
            continue
        if trace.get("type") == "heatmap":
            z = np.array([[np.nan if v is None else v for v in row] for row in trace["z"]], dtype=float)
            x, y = np.asarray(trace["x"], dtype=float), np.asarray(trace["y"], dtype=float)
            mesh = ax.pcolormesh(x, y, z, shading="nearest", cmap="viridis")
            fig.colorbar(mesh, ax=ax, shrink=0.8)
            if _layout_axis(layout, _axis_names(trace)[1], "y").get("autorange") == "reversed":
                ax.invert_yaxis()
            continue
        x = np.array([np.nan if v is None else v for v in trace["x"]], dtype=float)
        y = np.array([np.nan if v is None else v for v in trace["y"]], dtype=float)
        mode = trace.get("mode", "lines")
        line, marker = trace.get("line", {}), trace.get("marker", {})
        style = {"color": line.get("color") or marker.get("color"), "label": trace.get("name") if trace.get("showlegend", True) else None,
                 "alpha": trace.get("opacity", 1.0)}
        dash = {"dash": "--", "dot": ":", "dashdot": "-."}.get(line.get("dash", "solid"), "-")
        if "lines" in mode:
            ax.plot(x, y, linestyle=dash, lw=line.get("width", 1.5) * 0.7,
                    marker="o" if "markers" in mode else None, ms=3, **style)
        else:
            ax.plot(x, y, linestyle="none", marker="o", ms=3, **style)
    for (xa, ya), ax in where.items():
        xl, yl = _layout_axis(layout, xa, "x"), _layout_axis(layout, ya, "y")
        for spec, set_scale, set_label in ((xl, ax.set_xscale, ax.set_xlabel), (yl, ax.set_yscale, ax.set_ylabel)):
            if spec.get("type") == "log":
                set_scale("log")
            set_label(str(spec.get("title", {}).get("text", "")).replace("<sub>", "_").replace("</sub>", ""), fontsize=8)
        if "range" in yl and yl.get("type") != "log":
            ax.set_ylim(*yl["range"])
    for shape in layout.get("shapes", []):
        if shape.get("type") != "line":
            continue
        ax = where.get((shape.get("xref", "x").replace(" domain", ""), shape.get("yref", "y").replace(" domain", "")))
        if ax is None:
            ax = axs[0]
        color = shape.get("line", {}).get("color", "0.4")
        if shape.get("x0") == shape.get("x1") and "domain" in str(shape.get("yref", "")):
            ax.axvline(shape["x0"], color=color, lw=0.9, ls="--")
        elif shape.get("y0") == shape.get("y1") and "domain" in str(shape.get("xref", "")):
            ax.axhline(shape["y0"], color=color, lw=0.9, ls="--")
    if any(ax.get_legend_handles_labels()[1] for ax in axs):
        for ax in axs:
            if ax.get_legend_handles_labels()[1]:
                ax.legend(fontsize=6, loc="best")
    fig.suptitle(str(layout.get("title", {}).get("text", title)), fontsize=9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


# ----------------------------------------------------------------------------- shared pieces


def _vline(x: float, color: str = "#555555", xref: str = "x", yref: str = "y domain") -> dict:
    return {"type": "line", "x0": x, "x1": x, "y0": 0, "y1": 1, "xref": xref, "yref": yref,
            "line": {"color": color, "width": 1.2, "dash": "dash"}}


def _hline(y: float, color: str = "#555555", xref: str = "x domain", yref: str = "y") -> dict:
    return {"type": "line", "x0": 0, "x1": 1, "y0": y, "y1": y, "xref": xref, "yref": yref,
            "line": {"color": color, "width": 1.2, "dash": "dash"}}


def _note(text: str, x: float, y: float, xref: str = "x", yref: str = "y domain", **kw: Any) -> dict:
    """A text label. On a log axis Plotly places annotations by log10 of the value (shapes by
    the value itself), so callers pass ``math.log10(v)`` there."""
    return {"text": text, "x": x, "y": y, "xref": xref, "yref": yref, "showarrow": False,
            "font": {"size": 11}, **kw}


def _base_layout(title: str, **axes: Any) -> dict:
    return {"title": {"text": title, "font": {"size": 14}}, "height": 380,
            "margin": {"l": 60, "r": 20, "t": 50, "b": 50}, "legend": {"font": {"size": 10}},
            "template": "plotly_white", **axes}


def _check_values(values: object, name: str, *, minimum: float, integer: bool = False) -> tuple:
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(f"{name} must be a non-empty list, got {values!r}")
    out = []
    for v in values:
        ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
        if integer:
            ok = ok and float(v) == int(v)
        if not ok or not math.isfinite(float(v)) or float(v) < minimum:
            kind = "integers" if integer else "numbers"
            raise ValueError(f"{name} must hold finite {kind} >= {minimum:g}, got {v!r}")
        out.append(int(v) if integer else float(v))
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must not repeat a value, got {values!r}")
    return tuple(out)


def decay_bound(distance: np.ndarray, head_dim: int = 128, base: float = 10000.0) -> np.ndarray:
    """RoFormer's long-term decay bound, ``(1 / (d/2)) sum_j |S_j|`` with
    ``S_j = sum_{i<j} exp(1j r theta_i)``, in float64, for each distance ``r``."""
    check_positive_int(head_dim, "head_dim")
    theta = rope_frequencies(head_dim, float(base), dtype=torch.float64).numpy()
    partial = np.cumsum(np.exp(1j * np.outer(np.asarray(distance, dtype=np.float64), theta)), axis=1)
    return np.abs(partial).mean(axis=1)


def _fmt_int(n: float) -> str:
    return f"{n:,.0f}"


# ----------------------------------------------------------------------------- 1. RoPE's clock


def rope_clock(bases: Sequence[float] = (100.0, 1e4, 1e5, 5e5, 1e6, 1e7), head_dims: Sequence[int] = (64, 128),
               train_lens: Sequence[int] = (2048, 4096, 8192, 32768, 131072), *,
               default: tuple | None = None) -> InteractiveFigure:
    """Each pair's wavelength (the positions its hand needs for one full turn) against the
    training length: pairs above the line have not turned once in training.

    Controls: base, head dimension, training length. The readout gives the count of pairs that
    turn fully within the training length (wavelength at most ``L``: Liu et al.'s critical
    dimension over two, :func:`companion.recipe.critical_dimension`) and the slowest pair's
    wavelength ``2 pi b^((d-2)/d)``.
    """
    bases = _check_values(bases, "bases", minimum=1.0 + 1e-9)
    head_dims = _check_values(head_dims, "head_dims", minimum=2, integer=True)
    if any(d % 2 for d in head_dims):
        raise ValueError(f"head_dims must be even, got {head_dims}")
    train_lens = _check_values(train_lens, "train_lens", minimum=1, integer=True)
    controls = [
        Control("base", "base b", bases, tuple(f"{b:,.0f}" for b in bases)),
        Control("head_dim", "head dimension d", head_dims),
        Control("train_len", "training length L", train_lens, tuple(_fmt_int(n) for n in train_lens), kind="select"),
    ]
    layout = _base_layout(
        "RoPE's clock: positions each pair needs for one full turn",
        xaxis={"title": {"text": "pair i (0 turns fastest)"}, "zeroline": False},
        yaxis={"title": {"text": "wavelength 2\u03c0/\u03b8<sub>i</sub> (positions)"}, "type": "log",
               "exponentformat": "power"},
        showlegend=True,
    )
    fig = InteractiveFigure("rope-clock", "RoPE's clock", controls, layout)
    rope = scheme_color("rope")
    for b, d, L in itertools.product(bases, head_dims, train_lens):
        wl = (_TWO_PI / rope_frequencies(d, b, dtype=torch.float64)).numpy()
        pairs = np.arange(d // 2)
        full = wl <= L
        n_full = int(full.sum())
        data = [
            {"type": "scatter", "mode": "markers", "x": pairs[full], "y": wl[full], "name": "turns fully within L",
             "marker": {"color": rope, "size": 6}},
            {"type": "scatter", "mode": "markers", "x": pairs[~full], "y": wl[~full],
             "name": "never a full turn in training", "marker": {"color": "#000000", "size": 7, "symbol": "x"}},
        ]
        shapes = [_hline(L, color="#000000")]
        notes = [_note(f"training length L = {_fmt_int(L)}", 0.02, math.log10(L), xref="x domain", yref="y", yanchor="bottom",
                       xanchor="left")]
        readout = (f"b = {b:,.0f}, d = {d}, L = {_fmt_int(L)}: {n_full} of {d // 2} pairs turn fully within L; "
                   f"the slowest pair's wavelength is {wl[-1]:,.0f} positions.")
        fig.add((b, d, L), data, readout, {"shapes": shapes, "annotations": notes})
    if default is None:
        usual = (1e4, 128, 4096)
        default = usual if all(v in c.values for v, c in zip(usual, controls)) else (bases[0], head_dims[0], train_lens[0])
    return fig.with_default(default)


# ----------------------------------------------------------------------------- 2. score vs distance


def score_distance(bases: Sequence[float] = (100.0, 1e3, 1e4, 1e5, 5e5, 1e6), head_dim: int = 128,
                   max_distance: int = 32768, points: int = 240, samples: int = 64, seed: int = 0) -> InteractiveFigure:
    """RoPE's score against distance, with a base slider, as chapter 5 reads it.

    Three curves, each divided by its value at distance 0:

    * *similar keys*: the mean score ``q . R_r k`` of ``samples`` query/key pairs with
      ``k = q + noise`` (rotated by :func:`~companion.rope.apply_rope`), whose expectation is
      ``(2 / d) sum_i cos(r theta_i)``;
    * *unrelated keys*: the same with independent ``k`` (divided by the similar keys' value at
      0): noise around zero at every distance;
    * RoFormer's bound (:func:`decay_bound`).

    Distances are log-spaced from 1 to ``max_distance``. The readout names the first distance
    where the expected score of similar keys is below zero (over every integer distance), and
    whether the bound is monotone.
    """
    bases = _check_values(bases, "bases", minimum=1.0 + 1e-9)
    check_positive_int(head_dim, "head_dim")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    check_positive_int(max_distance, "max_distance")
    check_positive_int(points, "points")
    check_positive_int(samples, "samples")
    if max_distance < 2:
        raise ValueError(f"max_distance must be >= 2, got {max_distance}")
    dist = np.unique(np.round(np.geomspace(1, max_distance, points)).astype(np.int64))
    controls = [Control("base", "base b", bases, tuple(f"{b:,.0f}" for b in bases))]
    layout = _base_layout(
        f"RoPE's score against distance (d = {head_dim}), each curve over its value at 0",
        xaxis={"title": {"text": "distance r (positions)"}, "type": "log"},
        yaxis={"title": {"text": "score / score at r = 0"}, "range": [-0.6, 1.05]},
        legend={"orientation": "h", "y": -0.25, "font": {"size": 10}},
    )
    fig = InteractiveFigure("score-distance", "RoPE's score against distance", controls, layout)
    gen = seed_everything(seed)
    q = torch.randn(1, 1, samples, head_dim, dtype=torch.float64, generator=gen)
    similar = q + torch.randn(q.shape, dtype=torch.float64, generator=gen)
    unrelated = torch.randn(q.shape, dtype=torch.float64, generator=gen)
    everything = torch.from_numpy(np.concatenate([[0], dist]))   # distance 0, then each r
    n = len(everything)
    # The score of a query at position r and a key at position 0 depends only on r: rotate
    # the query by every distance at once (samples as heads, distances as the sequence).
    rows = q[0, 0][:, None, :].expand(samples, n, head_dim)[None]
    for b in bases:
        theta = rope_frequencies(head_dim, b, dtype=torch.float64)
        cos, sin = rope_cos_sin(everything, theta, compute_dtype=torch.float64)
        rotated, _ = apply_rope(rows, rows, cos, sin)
        curves = {name: (rotated[0] * key[0, 0][:, None, :]).sum(-1).mean(0).numpy()
                  for name, key in (("similar", similar), ("unrelated", unrelated))}
        ref = curves["similar"][0]
        sim, unrel = curves["similar"][1:] / ref, curves["unrelated"][1:] / ref
        bound_all = decay_bound(everything.numpy(), head_dim, b)
        bound = bound_all[1:] / bound_all[0]
        # the first distance, over every integer up to max_distance, where the expected score
        # of similar keys, (2 / d) sum_i cos(r theta_i), is below zero
        reach = longest_context_of(theta, limit=max_distance + 1)
        first_negative = reach if reach <= max_distance else None
        monotone = bool(np.all(np.diff(bound) <= 1e-12))
        data = [
            {"type": "scatter", "mode": "lines", "x": dist, "y": sim, "name": f"similar keys (mean of {samples})",
             "line": {"color": scheme_color("rope"), "width": 2}},
            {"type": "scatter", "mode": "lines", "x": dist, "y": unrel, "name": "unrelated keys",
             "line": {"color": "#7f7f7f", "width": 1}},
            {"type": "scatter", "mode": "lines", "x": dist, "y": bound, "name": "RoFormer's bound",
             "line": {"color": scheme_color("reference"), "width": 1.5, "dash": "dash"}},
        ]
        shapes = [_hline(0.0, color="#999999")]
        notes = []
        if first_negative is not None:
            shapes.append(_vline(first_negative, color=scheme_color("rope")))
            notes.append(_note(f"similar keys < 0 from r = {first_negative:,}", math.log10(first_negative), 0.97,
                               xanchor="right"))
        where = (f"similar keys first score below zero at r = {first_negative:,} (expected value)"
                 if first_negative is not None else f"similar keys stay above zero up to r = {max_distance:,}")
        probe = min(256, max_distance)
        at_probe = float(decay_bound(np.array([probe]), head_dim, b)[0] / bound_all[0])
        readout = (f"b = {b:,.0f}: {where}; the bound falls to {at_probe:.2f} at r = {probe:,} "
                   f"and is {'monotone' if monotone else 'not monotone'} over the plotted r \u2264 {max_distance:,}.")
        fig.add((b,), data, readout, {"shapes": shapes, "annotations": notes})
    return fig.with_default((1e4,) if 1e4 in bases else (bases[0],))


# ----------------------------------------------------------------------------- 3. scaling methods

#: The model configs the scaling figure offers, each ``(rope_theta, head_dim, native context)``
#: as in the model's ``config.json`` (Llama 3.1's is ``original_max_position_embeddings`` of its
#: ``rope_scaling``; SmolLM2's is checked against the GGUF that ``companion.llama`` runs).
MODEL_CONFIGS: dict[str, tuple[float, int, int]] = {
    "Llama 2 7B": (10000.0, 128, 4096),
    "Llama 3.1 8B": (500000.0, 128, 8192),
    "Qwen2 7B": (1000000.0, 128, 32768),
    "SmolLM2 135M": (100000.0, 64, 8192),
}

_METHODS = ("pi", "ntk", "dynamic", "yarn", "llama3", "longrope")
_METHOD_NAMES = {"pi": "PI", "ntk": "NTK-aware", "dynamic": "Dynamic NTK (at sL)", "yarn": "YaRN",
                 "llama3": "Llama 3 scaling", "longrope": "LongRoPE (searched)"}


def _method_config(method: str, factor: float, base: float, train_len: int, pairs: int,
                   long_factor: Sequence[float] | None) -> dict | None:
    if method == "pi":
        return {"rope_type": "linear", "rope_theta": base, "factor": factor}
    if method == "ntk":
        return {"rope_type": "ntk", "rope_theta": base, "factor": factor}
    if method == "dynamic":
        return {"rope_type": "dynamic", "rope_theta": base, "factor": factor}
    if method == "yarn":
        return {"rope_type": "yarn", "rope_theta": base, "factor": factor, "original_max_position_embeddings": train_len}
    if method == "llama3":
        return {"rope_type": "llama3", "rope_theta": base, "factor": factor, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": train_len}
    if long_factor is None:
        return None
    return {"rope_type": "longrope", "rope_theta": base, "factor": factor, "original_max_position_embeddings": train_len,
            "short_factor": [1.0] * pairs, "long_factor": [float(f) for f in long_factor]}


def scaling_methods(configs: Mapping[str, tuple[float, int, int]] | None = None,
                    factors: Sequence[float] = (2.0, 4.0, 8.0, 16.0, 32.0), *,
                    longrope: Mapping[str, Mapping[float, Sequence[float]]] | None = None,
                    default: tuple | None = None) -> InteractiveFigure:
    """Per-pair slow-down ``theta_i / theta_i'`` of every scaling method, against the pair's
    original wavelength, computed by :func:`~companion.scaling.compute_inv_freq`.

    Args:
        configs: ``name -> (rope_theta, head_dim, native context L)``; default
            :data:`MODEL_CONFIGS`.
        factors: the scale factors ``s`` of the slider.
        longrope: LongRoPE's searched long factors, ``config name -> {s: factors}`` (LongRoPE
            has no formula: its factors come from a search per model, so it is drawn only where
            one is given).
        default: the first state, ``(config, method, factor)``.

    Controls: model config, the method the readout describes (its points are drawn larger),
    and the factor (a method with fewer factors, LongRoPE, limits the slider). Dynamic NTK is shown at length ``s L``. The readout gives, for the chosen method,
    the pairs kept (slow-down within 1%), the pairs slowed by the full factor (within 1%), the
    slowest pair's new wavelength, and the attention factor.
    """
    configs = dict(MODEL_CONFIGS if configs is None else configs)
    if not configs:
        raise ValueError("configs must name at least one model")
    for name, value in configs.items():
        if not (isinstance(value, tuple) and len(value) == 3):
            raise ValueError(f"configs[{name!r}] must be (rope_theta, head_dim, native context), got {value!r}")
        _check_values([value[0]], f"configs[{name!r}] rope_theta", minimum=1.0 + 1e-9)
        _check_values([value[1]], f"configs[{name!r}] head_dim", minimum=2, integer=True)
        _check_values([value[2]], f"configs[{name!r}] native context", minimum=1, integer=True)
        if value[1] % 2:
            raise ValueError(f"configs[{name!r}] head_dim must be even, got {value[1]}")
    factors = _check_values(factors, "factors", minimum=1.0)
    longrope = dict(longrope or {})
    for name, per_factor in longrope.items():
        if name not in configs:
            raise ValueError(f"longrope names {name!r}, which is not one of the configs {list(configs)}")
        for s, found in dict(per_factor).items():
            pairs = configs[name][1] // 2
            if s not in factors:
                raise ValueError(f"longrope[{name!r}] has factors for s = {s!r}, which is not one of factors {list(factors)}")
            if not isinstance(found, (list, tuple)) or len(found) != pairs:
                raise ValueError(f"longrope[{name!r}][{s!r}] must list one factor per pair ({pairs}), got {found!r}")
    methods = tuple(m for m in _METHODS if m != "longrope" or longrope)
    controls = [
        Control("config", "model", tuple(configs), kind="select"),
        Control("method", "method", methods, tuple(_METHOD_NAMES[m] for m in methods), kind="select"),
        Control("factor", "factor s", factors, tuple(f"{s:g}" for s in factors)),
    ]
    layout = _base_layout(
        "How far each method slows each pair, against its original wavelength",
        xaxis={"title": {"text": "original wavelength 2\u03c0/\u03b8<sub>i</sub> (positions)"}, "type": "log",
               "exponentformat": "power"},
        yaxis={"title": {"text": "slow-down \u03b8<sub>i</sub>/\u03b8'<sub>i</sub>"}, "type": "log", "dtick": math.log10(2),
               "tickformat": ".3~g"},
        legend={"orientation": "h", "y": -0.28, "font": {"size": 10}},
    )
    fig = InteractiveFigure("scaling-methods", "Context-extension methods, pair by pair", controls, layout)
    for name, (base, d, L) in configs.items():
        pairs = d // 2
        theta = rope_frequencies(d, base, dtype=torch.float64)
        wl = (_TWO_PI / theta).numpy()
        for s in factors:
            found = longrope.get(name, {})
            per_method: dict[str, tuple[np.ndarray, float]] = {}
            for m in methods:
                long_factor = found.get(s) if m == "longrope" else None
                cfg = _method_config(m, s, base, L, pairs, long_factor)
                if cfg is None:
                    continue
                seq_len = int(round(s * L)) if m in ("dynamic", "longrope") else None
                inv, att = compute_inv_freq(cfg, d, max_position_embeddings=L, seq_len=seq_len)
                per_method[m] = (theta.numpy() / inv.double().numpy(), float(att))
            for chosen in methods:
                if chosen not in per_method:
                    continue
                data = []
                for m, (slow, _) in per_method.items():
                    style = METHOD_STYLES[m]
                    data.append({"type": "scatter", "mode": "lines+markers", "x": wl, "y": slow, "name": _METHOD_NAMES[m],
                                 "line": {"color": style["color"], "width": 3 if m == chosen else 1.2},
                                 "marker": {"color": style["color"], "size": 7 if m == chosen else 3},
                                 "opacity": 1.0 if m == chosen else 0.55})
                slow, att = per_method[chosen]
                kept = int(np.sum(np.abs(slow - 1) <= 0.01))
                full = int(np.sum(np.abs(slow / s - 1) <= 0.01))
                new_slowest = wl[-1] * slow[-1]
                shapes = [_vline(L), _vline(s * L, color="#999999")]
                notes = [_note("L", math.log10(L), 1.0, yanchor="bottom"),
                         _note("sL", math.log10(s * L), 1.0, yanchor="bottom")]
                readout = (f"{name} (b = {base:,.0f}, d = {d}, L = {_fmt_int(L)}), s = {s:g}, {_METHOD_NAMES[chosen]}: "
                           f"{kept} of {pairs} pairs kept, {full} slowed by the full {s:g}x; the slowest pair's "
                           f"wavelength goes from {wl[-1]:,.0f} to {new_slowest:,.0f} positions; attention factor "
                           f"{att:.4f}.")
                fig.add((name, chosen, s), data, readout, {"shapes": shapes, "annotations": notes})
    first = next(iter(configs))
    return fig.with_default(default or (first, "yarn", factors[min(2, len(factors) - 1)]))


# ----------------------------------------------------------------------------- 4. position biases

_BIAS_NAMES = {"alibi": "ALiBi", "t5": "T5 buckets", "kerple-log": "Kerple (log)", "kerple-power": "Kerple (power)",
               "fire": "FIRE"}


def position_biases(head_counts: Sequence[int] = (4, 8, 12, 16), *, span: int = 2048, grid: int = 20,
                    fire_queries: tuple[int, int] = (256, 2048), curve_points: int = 56, seed: int = 0,
                    default: tuple | None = None) -> InteractiveFigure:
    """Position biases as a matrix and as a curve of distance, head by head.

    Schemes: ALiBi (:func:`~companion.alibi.alibi_slopes`, the paper's rule, including its
    interleaving for head counts that are not powers of two), T5's buckets (causal, 32 buckets,
    ``max_distance`` 128: the bias is one learned number per bucket, so the figure shows the
    bucket index, shared by all heads), Kerple log and power, and FIRE. Kerple and FIRE are
    learned; they are shown at the reference initialisation (``seed``, one draw per head
    count), which training moves.

    Left: the bias over ``grid`` query and key positions spread over ``[0, span)`` (causal: keys
    after the query are blank). Right: the bias against distance ``i - j``; for FIRE, for a
    query at each of ``fire_queries``, which differ once the query passes FIRE's threshold
    ``L = 512``.

    Controls: scheme, head count, head.
    """
    head_counts = _check_values(head_counts, "head_counts", minimum=1, integer=True)
    check_positive_int(span, "span")
    check_positive_int(grid, "grid")
    check_positive_int(curve_points, "curve_points")
    if grid < 2 or grid > span:
        raise ValueError(f"grid must lie in [2, span = {span}], got {grid}")
    if not (isinstance(fire_queries, tuple) and len(fire_queries) == 2
            and all(isinstance(v, int) and 1 <= v < 10 ** 7 for v in fire_queries)):
        raise ValueError(f"fire_queries must be two positions in [1, 1e7), got {fire_queries!r}")
    schemes = tuple(_BIAS_NAMES)
    max_heads = max(head_counts)
    controls = [
        Control("scheme", "scheme", schemes, tuple(_BIAS_NAMES[s] for s in schemes), kind="select"),
        Control("heads", "head count", head_counts),
        Control("head", "head", tuple(range(max_heads)), tuple(str(h + 1) for h in range(max_heads))),
    ]
    layout = _base_layout(
        "Position biases: the matrix (left) and the curve of distance (right)",
        xaxis={"domain": [0.0, 0.36], "title": {"text": "key position j"}},
        yaxis={"title": {"text": "query position i"}, "autorange": "reversed"},
        xaxis2={"domain": [0.6, 1.0], "title": {"text": "distance i \u2212 j"}, "type": "log", "anchor": "y2"},
        yaxis2={"title": {"text": "bias added to the logit"}, "anchor": "x2"},
        legend={"x": 0.56, "y": 0.02, "font": {"size": 10}},
    )
    fig = InteractiveFigure("position-biases", "Position biases, head by head", controls, layout)
    pos = torch.from_numpy(np.round(np.linspace(0, span - 1, grid)).astype(np.int64))
    dist = torch.from_numpy(np.unique(np.round(np.geomspace(1, span - 1, curve_points)).astype(np.int64)))
    causal = pos[:, None] >= pos[None, :]
    buckets = t5_relative_position_bucket(pos[None, :] - pos[:, None], bidirectional=False).double()
    t5_curve = t5_relative_position_bucket(-dist, bidirectional=False).double()

    def matrix(values: torch.Tensor) -> list:
        return torch.where(causal, values.double(), torch.tensor(float("nan"), dtype=torch.float64)).tolist()

    for H in head_counts:
        seed_everything(seed)
        kl, kp, fire = KerpleBias(H, form="log"), KerpleBias(H, form="power"), FIRE(H)
        with torch.no_grad():
            mats = {
                "alibi": alibi_slopes(H).double()[:, None, None] * -(pos[:, None] - pos[None, :]).clamp(min=0).double(),
                "kerple-log": kl.bias(pos, pos), "kerple-power": kp.bias(pos, pos), "fire": fire.bias(pos, pos),
            }
            curves = {
                "alibi": alibi_slopes(H).double()[:, None] * -dist.double(),
                "kerple-log": kl.bias(torch.tensor([span]), span - dist)[:, 0],
                "kerple-power": kp.bias(torch.tensor([span]), span - dist)[:, 0],
            }
            fire_curves = [fire.bias(torch.tensor([i]), (i - dist).clamp(min=0))[:, 0] for i in fire_queries]
        slopes = alibi_slopes(H).tolist()
        r1l, r2l = kl.kernel_parameters()
        r1p, r2p = kp.kernel_parameters()
        for scheme, h in itertools.product(schemes, range(H)):
            color = scheme_color(scheme)
            if scheme == "t5":
                z, curve_sets = buckets, [(t5_curve, dist, "bucket index")]
                colorbar = "bucket"
            elif scheme == "fire":
                z = mats["fire"][h]
                curve_sets = [(c[h], dist[dist <= i], f"query at i = {i:,}") for c, i in zip(fire_curves, fire_queries)]
                curve_sets = [(y[: len(x)], x, n) for y, x, n in curve_sets]
                colorbar = "bias"
            else:
                z, curve_sets, colorbar = mats[scheme][h], [(curves[scheme][h], dist, _BIAS_NAMES[scheme])], "bias"
            data = [{"type": "heatmap", "x": pos, "y": pos, "z": matrix(z), "colorscale": "Viridis", "xaxis": "x",
                     "yaxis": "y", "showscale": True, "colorbar": {"x": 0.38, "len": 0.9, "thickness": 14, "title": {"text": colorbar}},
                     "name": _BIAS_NAMES[scheme], "hovertemplate": "i %{y}, j %{x}: %{z:.3g}<extra></extra>"}]
            for k, (y, x, label) in enumerate(curve_sets):
                data.append({"type": "scatter", "mode": "lines", "x": x, "y": y, "name": label, "xaxis": "x2",
                             "yaxis": "y2", "line": {"color": color, "width": 2, "dash": "dash" if k else "solid"}})
            if scheme == "alibi":
                what = f"slope m = {slopes[h]:.6g}: bias -m (i - j), {slopes[h] * 1000:.4g} at distance 1,000"
            elif scheme == "t5":
                what = "32 buckets, one per distance up to 15, then log-spaced up to 128; every head shares them"
            elif scheme == "kerple-log":
                what = f"-r1 log(1 + r2 (i - j)) with r1 = {r1l[h].item():.3f}, r2 = {r2l[h].item():.3f}"
            elif scheme == "kerple-power":
                what = f"-r1 (i - j)^r2 with r1 = {r1p[h].item():.3f}, r2 = {r2p[h].item():.3f}"
            else:
                shared = int((dist <= min(fire_queries)).sum())   # distances both queries reach
                same = float((fire_curves[0][h][:shared] - fire_curves[1][h][:shared]).abs().max())
                what = (f"an MLP of log(1 + c d) / log(1 + c max(L, i)); the curves for i = {fire_queries[0]:,} and "
                        f"{fire_queries[1]:,} differ by up to {same:.3f} over the shared distances")
            readout = f"{_BIAS_NAMES[scheme]}, head {h + 1} of {H}: {what}."
            fig.add((scheme, H, h), data, readout)
    return fig.with_default(default or ("alibi", head_counts[min(1, len(head_counts) - 1)], 0))
