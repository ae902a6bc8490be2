"""docs/vllm.md's table of `kv_connector_extra_config` settings gives each setting's default as the
code has it (`engine_adapter.vllm.config.ConnectorSettings`), and names every setting."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from engine_adapter.vllm.config import ConnectorSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
DESCRIBED = {"model_name", "token", "chunk_model_id"}  # defaults the table says in words


def test_the_settings_table_gives_the_codes_defaults():
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]*) \|", DOC.read_text(), re.M))
    for f in dataclasses.fields(ConnectorSettings):
        assert f.name in rows, f"docs/vllm.md has no row for {f.name}"
        if f.name in DESCRIBED:
            continue
        code = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        text = rows[f.name].strip().strip("`")
        try:
            doc = json.loads(text)  # 1.0, 5, true, "off", {}
        except json.JSONDecodeError:
            doc = text  # an address as it is
        assert doc == code, f"{f.name}: docs/vllm.md says {doc!r}, the code {code!r}"
