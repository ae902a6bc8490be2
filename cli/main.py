"""The `kvcraft` command: serve, repair, admin, demo, selftest, model, bench.

This front sits above the service, the client and the benchmarks (pyproject.toml's import
contracts), so each of them stays free of the others: `serve` and `repair` are the service's
own commands (`kvservice.cli`), `admin` is a client of a running service; the product's
commands live here (`demo`: kvcli.demo, `selftest`: kvcli.selftest, `model parity`:
kvcli.parity; `model fetch` builds the folder the benchmarks load too, kvbench.common.realmodel);
`bench` is the benchmarks' one front door (kvbench.catalog).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import import_module
from typing import Sequence

from kvservice import cli as service_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcraft", description="KV-cache service for RAG LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    service_cli.add_serve_arguments(sub.add_parser("serve", help="run the service (until SIGTERM)"))
    service_cli.add_repair_arguments(sub.add_parser("repair", help=service_cli.REPAIR_HELP))

    demo = sub.add_parser("demo", help="start a service and drive it end to end")
    demo.add_argument("--data-dir", help="default: a temporary directory")

    admin = sub.add_parser("admin", help="inspect or manage a running service")
    admin.add_argument("--address", default="127.0.0.1:50051")
    admin.add_argument("--admin-token")
    admin.add_argument("action", choices=["stats", "fidelity", "list", "get", "evict", "pin", "unpin", "flush",
                                          "config"])
    admin.add_argument("target", nargs="?", help="chunk key (get/evict/pin/unpin)")

    model = sub.add_parser("model", help="get the real pretrained model, SmolLM2-135M (docs/real-model.md)")
    model.add_argument("action", choices=["fetch", "parity"])
    model.add_argument("args", nargs=argparse.REMAINDER)

    # Their own options (kvcli.selftest, kvbench.catalog): everything after the word is passed through.
    sub.add_parser("selftest", add_help=False, help="prove the GPU data path on this host (docs/gpu.md)")
    sub.add_parser("bench", add_help=False, help="benchmarks: `kvcraft bench` lists them, `kvcraft bench report` "
                                                 "renders the results pages")

    a, rest = parser.parse_known_args(argv)
    if a.command == "selftest":
        from kvcli.selftest import main as selftest

        return selftest(rest)
    if a.command == "bench":
        return _bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.command == "serve":
        return service_cli.serve(a)
    if a.command == "repair":
        return service_cli.repair(a)
    if a.command == "demo":
        from kvcli.demo import run_demo

        return run_demo(a.data_dir)
    if a.command == "admin":
        return _admin(a)
    return import_module({"fetch": "kvbench.common.realmodel", "parity": "kvcli.parity"}[a.action]).main(a.args)


def _bench(argv: list[str]) -> int:
    from kvbench import catalog

    if not argv or argv[0] in ("-h", "--help", "list"):
        print(catalog.listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "report":
        from kvbench.report import main as report

        return report(rest)
    if name not in catalog.BENCHMARKS:
        print(f"kvcraft bench: no benchmark {name!r}\n\n{catalog.listing()}", file=sys.stderr)
        return 2
    return catalog.run(name, rest)


def _admin(a: argparse.Namespace) -> int:
    from functools import partial

    from google.protobuf import json_format

    from kvclient.client import KVClient
    from kvclient.errors import KVCraftError
    from kvclient.fidelity import fidelity_table

    # The proto's own field names, as grpcurl prints them (not JSON camelCase).
    MessageToDict = partial(json_format.MessageToDict, preserving_proto_field_name=True)
    with KVClient(a.address, admin_token=a.admin_token) as c:
        try:
            if a.action == "stats":
                out = MessageToDict(c.stats())
            elif a.action == "fidelity":
                print(fidelity_table(c.stats()), end="")
                return 0
            elif a.action == "list":
                out = MessageToDict(c.list_chunks())
            elif a.action == "config":
                print(c.config(), end="")
                return 0
            elif a.action == "flush":
                out = MessageToDict(c.flush())
            else:
                if not a.target:
                    print(f"kvcraft admin {a.action}: give a chunk key", file=sys.stderr)
                    return 2
                if a.action == "get":
                    out = [MessageToDict(v) for v in c.get_chunk(a.target)]
                elif a.action == "evict":
                    out = MessageToDict(c.evict(chunk_key=a.target))
                else:
                    out = {"variants": getattr(c, a.action)(chunk_key=a.target)}
        except KVCraftError as e:
            print(f"kvcraft admin {a.action}: {e}", file=sys.stderr)
            return 1
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
