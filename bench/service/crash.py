"""Crash-safety loop: SIGKILL the real server at random moments of a store/evict loop,
restart it, and check what survived (DESIGN "Service": write order and recovery).

After every restart:
  - every acknowledged store (not since evicted) is readable and bit-identical;
  - a store or evict in flight at the kill is either wholly there (bit-identical) or
    wholly gone: no partial write is visible;
  - no corrupt byte is served (every fetch is compared with what was sent);
  - no temporary or orphan payload file is left behind.

`kvcraft bench crash --rounds 200` runs it longer than the test suite does.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from kvbench import results
from kvbench.common.args import count
from kvclient.client import KVClient, Ref
from kvclient.errors import KVCraftError, NotFoundError
from kvcraft.keys import ModelSpec, chunk_key, variant_id
from kvservice.launcher import ServiceProcess

MODEL = ModelSpec("crash-loop", num_layers=3, num_kv_heads=2, head_dim=16, dtype="bfloat16").fingerprint()


@dataclass
class CrashReport:
    rounds: int = 0
    kills: int = 0
    acked_stores: int = 0
    acked_evicts: int = 0
    in_flight_at_kill: int = 0
    in_flight_found_complete: int = 0
    verified_fetches: int = 0
    violations: list[str] = field(default_factory=list)


def _layers(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    t = 16 + seed % 48
    return [(torch.randn(2, t, 16, generator=g).bfloat16(), torch.randn(2, t, 16, generator=g).bfloat16())
            for _ in range(3)]


def _tokens(seed: int) -> list[int]:
    return [(seed * 7919 + i) % 50000 for i in range(16 + seed % 48)]


def run(data_dir: Path, rounds: int, seed: int = 0, max_delay_s: float = 0.12) -> CrashReport:
    rng = random.Random(seed)
    rep = CrashReport()
    acked: dict[str, tuple[str, int]] = {}  # variant id -> (chunk key, seed)
    in_flight: dict[str, tuple[str, int]] = {}  # stores/evicts whose outcome the kill hid
    gone: dict[str, str] = {}  # variant id -> chunk key, deleted by an acknowledged evict
    next_seed = 0
    server = ServiceProcess(data_dir)
    server.start()
    try:
        for _ in range(rounds):
            rep.rounds += 1
            killer = threading.Timer(rng.uniform(0.0, max_delay_s), server.kill)
            killer.start()
            try:
                with KVClient(server.address, timeout=10) as c:
                    while True:
                        if acked and rng.random() < 0.25:
                            vid = rng.choice(sorted(acked))
                            in_flight[vid] = acked.pop(vid)
                            c.evict(variant_id=vid)
                            gone[vid] = in_flight.pop(vid)[0]
                            rep.acked_evicts += 1
                        else:
                            s, next_seed = next_seed, next_seed + 1
                            key = chunk_key(MODEL, _tokens(s))
                            vid = variant_id(key, [])
                            in_flight[vid] = (key, s)
                            c.store(MODEL, _tokens(s), _layers(s))
                            acked[vid] = in_flight.pop(vid)
                            rep.acked_stores += 1
            except KVCraftError:
                pass  # the kill landed
            killer.join()
            rep.kills += 1
            rep.in_flight_at_kill += len(in_flight)
            server.start()
            _verify(server, acked, in_flight, gone, rep)
    finally:
        server.close()
    return rep


def _verify(server: ServiceProcess, acked: dict, in_flight: dict, gone: dict, rep: CrashReport) -> None:
    with KVClient(server.address, timeout=30) as c:
        for vid in _not_identical(c, acked, rep):
            rep.violations.append(f"acknowledged variant {vid} (seed {acked[vid][1]}) lost or changed")
        for vid, (key, s) in list(in_flight.items()):
            present = bool(c.lookup(chunk_key=key).found)
            if present and not _identical(c, key, vid, s, rep):
                rep.violations.append(f"in-flight variant {vid} visible but not complete")
            if present:
                rep.in_flight_found_complete += 1
                acked[vid] = (key, s)
                gone.pop(vid, None)
            else:
                gone[vid] = key
            del in_flight[vid]
        for vid, key in gone.items():
            if vid in {v.variant_id for v in c.lookup(chunk_key=key).variants}:
                rep.violations.append(f"evicted variant {vid} came back")
        stats = c.stats()
        if stats.variants != len(acked):
            rep.violations.append(f"{stats.variants} variants stored, {len(acked)} expected")
    payloads = server.data_dir / "payloads"
    files = [p for p in payloads.rglob("*") if p.is_file()]
    stray = [p.name for p in files if not p.name.endswith(".kv")]
    if stray or len(files) != len(acked):
        rep.violations.append(f"{len(files)} payload files for {len(acked)} variants; stray: {stray[:3]}")


def _not_identical(c: KVClient, variants: dict[str, tuple[str, int]], rep: CrashReport, batch: int = 128) -> list[str]:
    """The variants (id -> (chunk key, seed)) not served bit-identical: `batch` in one fetch (the
    service's max_fetch_variants is 256), and each in its own only where that fetch finds one
    missing."""
    bad = []
    items = list(variants.items())
    for i in range(0, len(items), batch):
        part = dict(items[i:i + batch])
        got: dict[str, list] = {}
        try:
            for f in c.fetch_layers([Ref(key, vid) for vid, (key, _) in part.items()]):
                got.setdefault(f.variant_id, []).append((f.key, f.value))
        except NotFoundError:
            bad += [vid for vid, (key, s) in part.items() if not _identical(c, key, vid, s, rep)]
            continue
        rep.verified_fetches += len(part)
        bad += [vid for vid, (_, s) in part.items() if not _same(got.get(vid, []), _layers(s))]
    return bad


def _identical(c: KVClient, key: str, vid: str, s: int, rep: CrashReport) -> bool:
    try:
        got = [(f.key, f.value) for f in c.fetch_layers([Ref(key, vid)])]
    except NotFoundError:
        return False
    rep.verified_fetches += 1
    return _same(got, _layers(s))


def _same(got: list, want: list) -> bool:
    """Bit for bit, layer by layer."""
    return len(got) == len(want) and all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for (a, x), (b, y) in zip(got, want))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    p = argparse.ArgumentParser(prog="kvcraft bench crash", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=count(), default=200)
    p.add_argument("--seed", type=count(0), default=0)
    results.add_argument(p, "crash")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvcraft-crash-") as tmp:
        rep = run(Path(tmp) / "data", a.rounds, a.seed)
    print(json.dumps(asdict(rep), indent=2))
    results.save("crash", argv, {"seed": a.seed, **asdict(rep)}, a.json)
    return 0 if not rep.violations else 1


if __name__ == "__main__":
    raise SystemExit(main())
