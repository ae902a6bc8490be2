"""The tier contract is the base classes (kvservice/tiers/base.py): every capability a
tier or writer may have is a method or flag of `Tier` / `TierWriter` with a default
that says "not here", and the store and the server call it; they never ask a tier
what it is or what it has (getattr, hasattr, isinstance on a tier class).

The scan reads the source of kvservice/store and kvservice/server. A probe is:
getattr/hasattr naming an attribute any tier or writer class defines, or asked of
an object whose name says it is a tier or writer; isinstance/issubclass with a tier
or writer class. The second test proves the scan finds each kind.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kvservice
from kvservice.tiers import disk, gpu, host, remote, slab  # noqa: F401 - every tier class defined
from kvservice.tiers.base import PayloadShape, Tier, TierWriter

PACKAGE = Path(kvservice.__file__).parent
SCANNED = ("store", "server")
TIER_NAME = re.compile(r"tier|writer|home", re.IGNORECASE)


def _classes(root: type) -> list[type]:
    out, todo = [], [root]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


TIER_CLASSES = {c.__name__ for c in _classes(Tier) + _classes(TierWriter)}
CAPABILITIES = {name for c in _classes(Tier) + _classes(TierWriter) for name in vars(c) if not name.startswith("__")}


def _names(node: ast.AST) -> list[str]:
    """Identifiers of a Name / Attribute chain / Subscript / tuple of them."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr, *_names(node.value)]
    if isinstance(node, ast.Subscript):
        return _names(node.value)
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _names(elt)]
    return []


def probes(source: str, where: str = "<string>") -> list[str]:
    """Every tier capability probe in `source`, as "where:line: code"."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2):
            continue
        fn, obj, arg = node.func.id, node.args[0], node.args[1]
        if fn in ("getattr", "hasattr"):
            named = isinstance(arg, ast.Constant) and arg.value in CAPABILITIES
            tierish = any(TIER_NAME.search(n) for n in _names(obj))
            hit = named or tierish
        elif fn in ("isinstance", "issubclass"):
            hit = any(n in TIER_CLASSES or n.endswith(("Tier", "TierWriter")) for n in _names(arg))
        else:
            continue
        if hit:
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_store_and_the_server_never_probe_a_tier() -> None:
    files = sorted(f for pkg in SCANNED for f in (PACKAGE / pkg).rglob("*.py"))
    assert len(files) > 10
    found = [p for f in files for p in probes(f.read_text(), str(f.relative_to(PACKAGE.parent)))]
    assert found == [], "capability probes (make them methods of Tier / TierWriter):\n" + "\n".join(found)


@pytest.mark.parametrize(("code", "probe"), [
    ('fill = getattr(writer, "fill_from", None)', True),
    ('gpu = next((t for t in tiers if hasattr(t, "ipc_handle")), None)', True),
    ('path_of = getattr(source, "path_of", None)', True),  # a tier's attribute, whatever the object is called
    ("getattr(self.s.tiers[i], name)", True),  # a tier, whatever the attribute
    ("remote = next(t for t in tiers if isinstance(t, RemoteTier))", True),
    ("ok = isinstance(w, (SlabWriter, bytes))", True),
    ('hasattr(fcntl, "F_GET_SEALS")', False),
    ("isinstance(e, OSError)", False),
    ("getattr(owners[0], m.name)", False),
])
def test_the_scan_finds_each_kind_of_probe(code: str, probe: bool) -> None:
    assert bool(probes(code)) is probe


# -- the defaults: a tier that implements only the abstract methods ---------------------
class _Writer(TierWriter):
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write_layer(self, *parts) -> None:  # noqa: ANN002
        self.parts.append(b"".join(bytes(p) for p in parts))

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


class _Tier(Tier):
    name = "plain"

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.held = {"v": b"\x01\x02\x03\x04" * 2}

    def open_writer(self, variant_id: str, shape: PayloadShape) -> TierWriter:
        return _Writer()

    def get_layer(self, variant_id: str, layer: int, shape: PayloadShape) -> memoryview:
        data = self.held[variant_id]
        return memoryview(data)[shape.offset(layer) : shape.offset(layer + 1)]

    def delete(self, variant_id: str) -> None:
        self.held.pop(variant_id, None)

    def usage(self) -> int:
        return sum(map(len, self.held.values()))

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self.held

    def __len__(self) -> int:
        return len(self.held)

    def variant_ids(self) -> list[str]:
        return list(self.held)


def test_a_tier_without_capabilities_answers_every_one_with_its_default() -> None:
    tier, shape = _Tier(), PayloadShape(2, 4)
    assert tier.path_of("v") is None and tier.read_record("v") is None and tier.mapping("v") is None
    assert tier.ipc_pool() is None and tier.pool_location("v") is None and tier.cluster_view() is None
    assert not (tier.shared or tier.persistent or tier.mappable or tier.verify_reads or tier.cache_on_store)
    tier.bind(lambda vid: None)
    with pytest.raises(NotImplementedError):
        tier.adopt("w", 8)
    room = memoryview(bytearray(4))
    tier.read_layer_into("v", 1, shape, room)  # the default copies from get_layer
    assert bytes(room) == b"\x01\x02\x03\x04"
    with pytest.raises(KeyError):
        tier.read_layer_into("gone", 0, shape, room)

    w = tier.open_writer("w", shape)
    w.describe(b"record")
    w.open_reader()
    w.close_reader()
    assert not w.reads_back and w.fill_layer(lambda room: None) is None
    assert w.fill_from(tier, "v", shape, None) is False
    with pytest.raises(NotImplementedError):
        w.read_back(0, room)
    assert w.parts == []  # no default wrote anything


# -- where a variant lives -----------------------------------------------------------------
def test_a_variants_tier_is_derived_from_the_tiers_in_one_place() -> None:
    """The tiers record which of them hold a variant; the store writes `Variant.tier`
    (their fastest) in `StoreState.retier` only, and a CP-Tree node keeps no tier."""
    writers = []
    for f in sorted((PACKAGE / "store").rglob("*.py")):
        tree = ast.parse(f.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if isinstance(el, ast.Attribute) and el.attr == "tier":
                            writers.append(f"{f.name}:{fn.name}")
    assert writers == ["state.py:retier"]

    from kvservice.planner.cp_tree import CPNode

    assert "tier" not in CPNode.__slots__
