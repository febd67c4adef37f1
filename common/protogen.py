"""Generate Python code from protos/ (the `make proto` target).

Generated modules are not committed; this writes them next to their .proto
files (`protos/kvgate/v1/*_pb2.py`, `*_pb2_grpc.py`, `*_pb2.pyi`) and rewrites
their imports to be relative, so they import as `protos.kvgate.v1.*`.
"""

from __future__ import annotations

import re
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
# `from kvgate.v1 import x_pb2 as y` -> `from . import x_pb2 as y` (same proto package).
ABSOLUTE_IMPORT = re.compile(r"^from kvgate\.v1 import ", re.MULTILINE)


def run_protoc(protos: list[Path]) -> None:
    """Run grpc_tools.protoc on `protos`, writing next to them.

    Args:
        protos: .proto files under PROTO_ROOT.
    """
    from grpc_tools import protoc

    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={well_known}",
        f"--python_out={PROTO_ROOT}",
        f"--pyi_out={PROTO_ROOT}",
        f"--grpc_python_out={PROTO_ROOT}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {len(protos)} file(s) under {PROTO_ROOT}")


def make_imports_relative(path: Path) -> None:
    """Rewrite a generated module's imports of its sibling modules to relative ones."""
    text = path.read_text()
    path.write_text(ABSOLUTE_IMPORT.sub("from . import ", text))


def generated_files() -> list[Path]:
    """Every generated file under PROTO_ROOT."""
    return sorted(p for p in PROTO_ROOT.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def main() -> int:
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    if not protos:
        print("no .proto files under protos/: nothing to generate")
        return 0
    for stale in generated_files():
        stale.unlink()
    run_protoc(protos)
    outputs = generated_files()
    for path in outputs:
        make_imports_relative(path)
    print(f"generated {len(outputs)} files from {len(protos)} protos under {PROTO_ROOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
