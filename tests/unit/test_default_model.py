"""Which model is served when none is named: the processes' --model default
(common/model_files.py default_model, read once into common/config.py DEFAULT_MODEL) and the
local stack's choice (deploy/models.py choose_model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.model_files import CACHE_DIR_ENV, DEFAULT_GGUF_NAME, STORIES_260K, default_model
from deploy import models
from deploy.models import choose_model
from executor.config import ExecutorConfig
from tests.helpers import REPO


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder; returns where `make setup` would put the chat model."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv("KVGATE_MODEL", raising=False)
    return tmp_path / "cache" / "models" / DEFAULT_GGUF_NAME


def cache_the_gguf(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")


def test_the_processes_default_is_the_cached_gguf_else_stories260k(cache: Path):
    assert default_model() == STORIES_260K
    cache.mkdir(parents=True)  # a folder of that name is not the file
    assert default_model() == STORIES_260K
    cache.rmdir()
    cache_the_gguf(cache)
    assert default_model() == str(cache)


def test_default_model_is_read_when_the_process_starts(cache: Path):
    """DEFAULT_MODEL is what --model defaults to, in a process started after `make setup`."""
    cache_the_gguf(cache)
    code = "from common.config import DEFAULT_MODEL; print(DEFAULT_MODEL)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == str(cache)


def test_kvgate_model_overrides_the_default(cache: Path, monkeypatch: pytest.MonkeyPatch):
    cache_the_gguf(cache)
    monkeypatch.setenv("KVGATE_MODEL", str(STORIES_260K))
    assert ExecutorConfig.from_args([]).engine.model == str(STORIES_260K)
    assert choose_model() == Path(STORIES_260K)


def test_the_local_stack_serves_the_cached_gguf_else_stories260k_else_a_built_one(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    assert choose_model() == models.SHARED_MODEL
    cache_the_gguf(cache)
    assert choose_model() == cache
    cache.unlink()
    monkeypatch.setattr(models, "SHARED_MODEL", tmp_path / "absent")
    monkeypatch.setattr(models, "TINY_MODEL_DIR", tmp_path / "tiny")
    built = []
    monkeypatch.setattr(models, "build_tiny_model", built.append)  # building it takes seconds
    assert choose_model() == tmp_path / "tiny" and built == [tmp_path / "tiny"]
