"""The gRPC service config the client ships: which methods gRPC retries, and the copy of it
in the docs that clients in other languages take."""

from __future__ import annotations

import json
import re

from client.retry import SERVICE_CONFIG, UNARY_METHODS
from tests.helpers import REPO


def test_grpc_retries_every_unary_method_and_no_stream():
    (config,) = SERVICE_CONFIG["methodConfig"]
    named = {(n["service"], n["method"]) for n in config["name"]}
    assert named == {
        ("kvgate.v1.Inference", method) for method in ("Tokenize", "GetModelInfo", "EndSession")
    }
    assert set(UNARY_METHODS) == {method for _, method in named}
    assert config["retryPolicy"]["retryableStatusCodes"] == ["ABORTED", "UNAVAILABLE"]


def test_the_docs_print_the_service_config_the_client_uses():
    text = (REPO / "docs" / "failures.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", text, re.DOTALL)
    configs = [json.loads(block) for block in blocks if '"methodConfig"' in block]
    assert configs == [SERVICE_CONFIG], "docs/failures.md must print client/retry.py's config"
