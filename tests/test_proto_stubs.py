"""The committed stubs are what scripts/gen_proto.sh makes from the proto today."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_match_the_proto(tmp_path):
    out = tmp_path / "gen"
    out.mkdir()
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"), f"--python_out={out}",
                    f"--pyi_out={out}", f"--grpc_python_out={out}", str(ROOT / "proto/kvcraft/v1/kvcraft.proto")],
                   check=True)
    for name in ("kvcraft_pb2.py", "kvcraft_pb2.pyi", "kvcraft_pb2_grpc.py"):
        assert filecmp.cmp(out / "kvcraft/v1" / name, ROOT / "proto/kvcraft/v1" / name, shallow=False), (
            f"{name} is stale: run scripts/gen_proto.sh")
