"""Markdown pieces every results view uses: a table, number formats, and the line under a
table that says which run it shows (command, date, machine; the results file linked)."""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}%}"


def num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:,.{digits}f}"


def times(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:.{digits}f}x"


def machine(m: dict[str, Any]) -> str:
    """The machine in a few words: CPU model (where recorded), cores, torch and vLLM versions."""
    parts = [m["cpu"] if m.get("cpu") else None, f"{m['cores']} cores" if m.get("cores") else None]
    parts += [f"torch {m['torch']}" if m.get("torch") else None, f"vLLM {m['vllm']}" if m.get("vllm") else None]
    return ", ".join(p for p in parts if p)


def source(name: str, result: dict[str, Any]) -> str:
    """`command` · date · machine ([name](results/name)): what made this table."""
    return (f"`{result['command']}` · {result['date'][:10]} · {machine(result['machine'])} "
            f"([{name}](results/{name}))")


def sources(named: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One "Run:" line per results file, under the tables made from them."""
    return "\n".join(f"Run: {source(n, r)}.  " if i < len(named) - 1 else f"Run: {source(n, r)}."
                     for i, (n, r) in enumerate(named))
