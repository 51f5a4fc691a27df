"""The package surface: exports, the hook map, import hygiene, and the documented examples."""

import re
import subprocess
import sys
from pathlib import Path

import companion

ROOT = Path(__file__).resolve().parents[1]

# The book's map of hooks (book/intro.md, chapter 1): which hook each scheme class uses.
EXPECTED_HOOKS = {
    "NoPE": (),
    "SinusoidalEmbedding": ("embed",),
    "ScaledSinusoidalEmbedding": ("embed",),
    "LearnedPositionalEmbedding": ("embed",),
    "ShawRelative": ("score",),
    "TransformerXL": ("score",),
    "T5RelativeBias": ("bias",),
    "RotaryEmbedding": ("rotate",),
    "ALiBi": ("bias",),
    "XPos": ("rotate",),
    "PRoPE": ("rotate",),
    "KerpleBias": ("bias",),
    "FIRE": ("bias",),
    "CoPE": ("score",),
}


def test_every_exported_name_exists():
    missing = [name for name in companion.__all__ if not hasattr(companion, name)]
    assert missing == []


def test_scheme_hooks_match_the_book_map():
    assert {cls.__name__: cls.hooks() for cls in companion.SCHEMES} == EXPECTED_HOOKS


# How book/intro.md's map names each scheme class.
INTRO_NAMES = {
    "NoPE": "NoPE", "SinusoidalEmbedding": "sinusoidal", "ScaledSinusoidalEmbedding": "scaled sinusoidal",
    "LearnedPositionalEmbedding": "learned", "ShawRelative": "Shaw et al.", "TransformerXL": "Transformer-XL",
    "T5RelativeBias": "T5 buckets", "RotaryEmbedding": "RoPE and its context extension", "ALiBi": "ALiBi",
    "XPos": "xPos", "PRoPE": "p-RoPE", "KerpleBias": "Kerple", "FIRE": "FIRE", "CoPE": "CoPE",
}


def test_intro_map_lists_every_scheme_under_its_hooks():
    """The intro's table of hooks names, per hook, exactly the classes of companion.SCHEMES
    that override it (NoPE, with no hook, on the row marked with a dash)."""
    text = (ROOT / "book" / "intro.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and (cells[0].startswith("`") or cells[0] == "—"):
            rows[cells[0].strip("`")] = {n.strip() for n in cells[2].split(",")}
    assert set(INTRO_NAMES) == {cls.__name__ for cls in companion.SCHEMES}
    expected = {hook: {INTRO_NAMES[c.__name__] for c in companion.SCHEMES if hook in c.hooks()}
                for hook in companion.HOOKS}
    expected["—"] = {INTRO_NAMES[c.__name__] for c in companion.SCHEMES if not c.hooks()}
    assert rows == expected


def test_import_does_not_pull_optional_parts():
    code = (
        "import sys, companion; "
        "print(sorted(m for m in ('triton', 'companion.kernels', 'companion.pretrained', "
        "'companion.hf', 'transformers', 'matplotlib', 'safetensors') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_package_page_examples_run():
    """The code blocks of book/package.md run as written (they share one namespace)."""
    text = (ROOT / "book" / "package.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "book/package.md", "exec"), namespace)  # noqa: S102
    # What the page's comments promise, checked on the namespace the blocks leave behind.
    import math

    import torch

    from companion.llama import LlamaModel
    from companion.trainfree import ReRoPE

    ns = namespace
    q, k = ns["q"], ns["k"]
    assert ns["cos"].shape == ns["sin"].shape == (16, 16) and ns["cos"].dtype == torch.float32
    assert ns["q_rot"].shape == q.shape and ns["k_rot"].shape == k.shape
    inv_freq, factor = ns["inv_freq"], ns["attention_factor"]
    assert inv_freq.shape == (64,) and inv_freq.dtype == torch.float32
    assert math.isclose(factor, 0.1 * math.log(4.0) + 1.0, rel_tol=1e-12) and f"{factor:.4f}" == "1.1386"
    assert torch.equal(ns["rope"].inv_freq, inv_freq) and ns["rope"].attention_scaling == factor
    model, ids = ns["model"], ns["ids"]
    assert isinstance(model, LlamaModel) and ids.shape[0] == 1
    assert isinstance(ns["text"], str) and ns["text"].startswith("def add(a, b):")
    # the chat helpers: the reply of render_chat + generate + decode, streamed or not
    from companion.llama import render_chat
    tok = ns["tokenizer"]
    prompt = torch.tensor([tok.encode(render_chat(model.config.chat_template, ns["chat"])).ids])
    assert ns["reply"] == tok.decode(model.generate(prompt, 16)[0, prompt.shape[1]:].tolist()) and "Paris" in ns["reply"]
    assert ns["piece"] and ns["reply"].endswith(ns["piece"])
    # "ids this short are all neighbours: plain RoPE": the Self-Extend loss is the plain loss
    # (plain RoPE again in both, after the chat block), up to the float32
    # rounding of two attention paths; a method that does move positions is far off
    nll, plain = ns["nll"], model.token_nll(ids)
    assert nll.shape == plain.shape == (1, ids.shape[1] - 1) and bool(torch.isfinite(nll).all())
    torch.testing.assert_close(nll, plain, rtol=0, atol=1e-4)
    with model.attention_mode(ReRoPE(window=2)):
        assert float((model.token_nll(ids) - plain).abs().max()) > 1e-2
    assert ns["mpos"].shape == (7, 3) and ns["delta"].shape == ()
    hybrid = ns["hybrid"]
    assert [type(block.attn.scheme).__name__ for block in hybrid.blocks] == ["RotaryEmbedding", "NoPE"] * 2


def test_conventions_page_examples_run(capsys):
    """The code blocks of book/conventions.md run as written, and what they print is the
    ``text`` block that follows them on the page."""
    text = (ROOT / "book" / "conventions.md").read_text()
    pairs = re.findall(r"```python\n(.*?)```(?:\s*(?:prints\s*)?```text\n(.*?)```)?", text, re.S)
    assert len(pairs) >= 3 and sum(bool(out) for _, out in pairs) >= 2
    namespace: dict = {}
    for block, printed in pairs:
        exec(compile(block, "book/conventions.md", "exec"), namespace)  # noqa: S102
        out = capsys.readouterr().out
        assert out == printed, block


def test_the_wheel_ships_the_typed_marker(tmp_path):
    """`py.typed` (PEP 561) is in the built wheel, not only in the source tree."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--disable-pip-version-check", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("pe_companion-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "companion/py.typed" in names
    assert "companion/lab/__main__.py" in names and not any(n.startswith("tests/") for n in names)


def test_api_page_bring_your_own_scheme_example(tmp_path, monkeypatch):
    """book/api.md's scheme, saved as myenc.py as the page says, goes through the lab by its
    import path: built with the keywords the lab passes, trained a step, and its bias is the
    table entry of each clipped distance."""
    import torch

    text = (ROOT / "book" / "api.md").read_text()
    section = text[text.index("### Bring your own scheme"):text.index("### Training and evaluation")]
    module, usage = re.findall(r"```python\n(.*?)```", section, re.S)
    (tmp_path / "myenc.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict = {}
    exec(compile(usage, "book/api.md", "exec"), namespace)  # noqa: S102
    scheme, model = namespace["scheme"], namespace["model"]
    assert type(model.scheme).__name__ == "DistanceBias" and model.scheme.table.shape == (4, 128)
    with torch.no_grad():
        scheme.table.copy_(torch.arange(4 * 128, dtype=torch.float32).view(4, 128))
        pos = torch.arange(200)
        bias = scheme.bias(pos, pos)
    q, k = torch.meshgrid(pos, pos, indexing="ij")
    want = torch.arange(4)[:, None, None] * 128 + (q - k).clamp(0, 127)
    assert torch.equal(bias, want.float())
    # one training step of the lab's own trainer, with the scheme named by its import path
    from companion.lab import TrainConfig, load_corpus, train

    cfg = TrainConfig(scheme="myenc:DistanceBias", d_model=16, n_heads=2, n_layers=1, seq_len=32, batch_size=2,
                      max_len=64, steps=1, warmup=1)
    trained, record = train(cfg, load_corpus(), progress=False)
    assert type(trained.scheme).__name__ == "DistanceBias" and record["log"][-1]["step"] == 1
    # the commands the page gives use the same name
    assert "--schemes rope alibi myenc:DistanceBias --quick" in section


def _map_rows(text: str) -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """hook -> (schemes, chapters) of a markdown table with columns hook | ... | schemes | chapter."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and (cells[0].startswith("`") or cells[0] == "—"):
            rows[cells[0].strip("`")] = (frozenset(n.strip() for n in cells[2].split(",")),
                                         frozenset(c.strip() for c in cells[3].split(",")))
    return rows


def test_chapter_one_map_agrees_with_the_intro_map():
    """Chapter 1 computes the map of hooks from the package (its glued table ``hook_map``); the
    intro types it. Both name the same schemes under each hook, and the same chapters."""
    import nbformat

    nb = nbformat.read(ROOT / "chapters" / "01_why_position.ipynb", as_version=4)
    glued = [o["data"]["text/markdown"] for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if o.get("metadata", {}).get("scrapbook", {}).get("name") == "hook_map"]
    assert len(glued) == 1, "chapter 1 must glue exactly one 'hook_map'"
    chapter_one = _map_rows(glued[0])
    intro = _map_rows((ROOT / "book" / "intro.md").read_text())
    assert set(chapter_one) == set(companion.HOOKS) | {"—"}
    assert chapter_one == intro
