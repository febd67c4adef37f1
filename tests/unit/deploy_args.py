"""What the deployment files (image, compose, Kubernetes) run, checked against the project.

A container runs `python -m ROLE ARGS` (the image's entrypoint is `python -m`), with KVGATE_*
environment variables set by the image and the deployment file. These helpers parse ARGS with
that process's own argument parser and build its config, so that a flag the process does not
take, or a value it refuses, fails the test with the process's own message.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path

from dockerfile_parse import DockerfileParser

from executor.config import ExecutorConfig
from executor.config import build_parser as executor_parser
from gateway.config import GatewayConfig
from gateway.config import build_parser as gateway_parser
from scheduler.config import SchedulerConfig
from scheduler.config import build_parser as scheduler_parser
from tests.helpers import REPO, STORIES_260K

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "gateway": gateway_parser,
    "scheduler": scheduler_parser,
    "executor": executor_parser,
}


def _from_fields(config_class: type) -> Callable[[dict[str, object]], object]:
    """Builds `config_class` from the parsed values its fields take."""
    names = {f.name for f in fields(config_class) if f.init}
    return lambda values: config_class(**{k: v for k, v in values.items() if k in names})


CONFIGS: dict[str, Callable[[dict[str, object]], object]] = {
    "gateway": _from_fields(GatewayConfig),
    "scheduler": _from_fields(SchedulerConfig),
    "executor": ExecutorConfig.from_flags,
}
ENV_NAME = re.compile(r"\bKVGATE_[A-Z0-9_]+\b")


def image_env() -> dict[str, str]:
    """The environment the image's final stage sets (ARGs at their defaults)."""
    return dict(DockerfileParser(path=str(DOCKERFILE)).envs)


def env_names_read_by_the_code() -> set[str]:
    """Every KVGATE_* name that a Python file of the project mentions."""
    names: set[str] = set()
    for package in (
        "common", "gateway", "scheduler", "executor", "engine", "kernels", "client", "deploy"
    ):  # fmt: skip
        for path in (REPO / package).rglob("*.py"):
            names.update(ENV_NAME.findall(path.read_text()))
    return names


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ as a container would have it: only `env` among the KVGATE_* names."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("KVGATE_")]:
        del os.environ[name]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def parse_container(
    command: list[str], env: dict[str, str], where: str
) -> tuple[str, argparse.Namespace]:
    """Parses `python -m ROLE ARGS` (command = [ROLE, *ARGS]) as that process would.

    Returns: the role and its parsed flags. Fails naming `where` on a flag the process
    does not take.
    """
    role, *args = command
    assert role in PARSERS, f"{where}: runs {role!r}; expected one of {sorted(PARSERS)}"
    said = io.StringIO()
    with environment(env), contextlib.redirect_stderr(said):
        try:
            parsed = PARSERS[role]().parse_args(args)
        except SystemExit:
            raise AssertionError(
                f"{where}: python -m {role} refuses its arguments: {said.getvalue()}"
            ) from None
    return role, parsed


def check_container(command: list[str], env: dict[str, str], where: str) -> object:
    """Parses the container's command and builds the process's validated config.

    The model folder and the device are those of this machine (the image's /models and a
    GPU are not here); every other value is the container's own.

    Returns: the config.
    """
    role, parsed = parse_container(command, env, where)
    values = vars(parsed)
    if "model" in values:
        values["model"] = str(STORIES_260K)
    if "device" in values:
        values["device"] = "cpu"
    try:
        return CONFIGS[role](values)
    except ValueError as error:
        raise AssertionError(f"{where}: python -m {role} refuses a value: {error}") from None


def listened_ports(config: object) -> set[int]:
    """The fixed ports a process with `config` listens on (a gateway: gRPC, HTTP, TokenSink;
    an executor: KvTransfer; every process: metrics and health); 0 (a free port) and -1
    (none) are left out."""
    names = (
        "port", "http_port", "internal_port", "kv_transfer_port", "metrics_port", "health_port"
    )  # fmt: skip
    ports = (getattr(config, name, 0) for name in names)
    return {port for port in ports if port > 0}


def module_exists(module: str) -> bool:
    """Whether `python -m module` names a module of this project."""
    path = REPO / Path(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()
