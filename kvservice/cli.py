"""`kvcraft` command line: serve, demo, admin, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from kvservice.config import load_config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcraft", description="KV-cache service for RAG LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the service (until SIGTERM)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--data-dir")
    serve.add_argument("--config", help="TOML file (settings: docs/configuration.md)")
    serve.add_argument("--metrics-port", type=int)

    demo = sub.add_parser("demo", help="start a service and drive it end to end")
    demo.add_argument("--data-dir", help="default: a temporary directory")

    admin = sub.add_parser("admin", help="inspect or manage a running service")
    admin.add_argument("--address", default="127.0.0.1:50051")
    admin.add_argument("--admin-token")
    admin.add_argument("action", choices=["stats", "list", "get", "evict", "pin", "unpin", "flush", "config"])
    admin.add_argument("target", nargs="?", help="chunk key (get/evict/pin/unpin)")

    bench = sub.add_parser("bench", help="benchmarks (bench/)")
    bench.add_argument("name", choices=["planner", "plan-latency", "crash", "fetch", "load"])
    bench.add_argument("args", nargs=argparse.REMAINDER)

    a = parser.parse_args(argv)
    if a.command == "serve":
        return _serve(a)
    if a.command == "demo":
        from kvservice.demo import run_demo

        return run_demo(a.data_dir)
    if a.command == "admin":
        return _admin(a)
    if a.command == "bench":
        from importlib import import_module

        return import_module(f"kvbench.{a.name.replace('-', '_')}").main(a.args)
    return 2


def _serve(a: argparse.Namespace) -> int:
    try:
        cfg = load_config(a.config, overrides={"host": a.host, "port": a.port, "data_dir": a.data_dir,
                                               "metrics_port": a.metrics_port})
        cfg.check_tls_files()
    except (OSError, ValueError) as e:
        print(f"kvcraft serve: bad configuration: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    import uvloop

    from kvservice.server import serve

    def ready(running) -> None:  # noqa: ANN001 - RunningServer
        # One parseable line: tests and scripts wait for it (port 0 picks a free port).
        print(f"kvcraft serving on {cfg.host}:{running.port} data_dir={cfg.data_dir}"
              + (f" metrics_port={running.metrics.port}" if running.metrics.port else ""), flush=True)

    try:
        uvloop.run(serve(cfg, on_ready=ready))
    except OSError as e:
        print(f"kvcraft serve: {e}", file=sys.stderr)
        return 1
    return 0


def _admin(a: argparse.Namespace) -> int:
    from functools import partial

    from google.protobuf import json_format

    # The proto's own field names, as grpcurl prints them (not JSON camelCase).
    MessageToDict = partial(json_format.MessageToDict, preserving_proto_field_name=True)
    from kvclient.client import KVClient
    from kvclient.errors import KVCraftError

    with KVClient(a.address, admin_token=a.admin_token) as c:
        try:
            if a.action == "stats":
                out = MessageToDict(c.stats())
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
