"""`kvcraft serve`: run the service until SIGTERM; `kvcraft repair`: rebuild its metadata.

The service's own command line knows only `serve` and `repair` (it imports nothing above the
service). The `kvcraft` command users run is the front in `kvcli.main`, which
hands `serve` to `main` here; `python -m kvservice.cli serve` is the same thing
without the front (`kvservice.launcher` starts servers that way).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from kvservice.config import STARTER_PID_ENV, load_config


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--data-dir")
    serve.add_argument("--config", help="TOML file (settings: docs/configuration.md)")
    serve.add_argument("--metrics-port", type=int)


def add_repair_arguments(repair: argparse.ArgumentParser) -> None:
    repair.add_argument("--data-dir")
    repair.add_argument("--config", help="TOML file (its data_dir is repaired)")


REPAIR_HELP = "rebuild damaged metadata from the payload files (refused while a service holds the data dir)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcraft", description="KV-cache service for RAG LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(sub.add_parser("serve", help="run the service (until SIGTERM)"))
    add_repair_arguments(sub.add_parser("repair", help=REPAIR_HELP))
    a = parser.parse_args(argv)
    return repair(a) if a.command == "repair" else serve(a)


def starter_pid() -> int:
    """The process that started this one (exit_with_parent): the launcher's pid where it says
    (`KVCRAFT_STARTER_PID`) and it is gone already, this process then an orphan from its start
    (the watch drains at once); else the parent now, while it surely lives."""
    parent = os.getppid()
    try:
        starter = int(os.environ.get(STARTER_PID_ENV, ""))
    except ValueError:
        return parent
    if starter == parent:
        return parent
    # another parent: the starter exited (reparented), or a process between them (a prefix that forked)
    return starter if exited(starter) else parent


def exited(pid: int) -> bool:
    """Whether process `pid` is gone or has exited (a zombie has), by /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def serve(a: argparse.Namespace) -> int:
    parent = starter_pid()  # first, while the starter surely lives
    try:
        cfg = load_config(a.config, overrides={"host": a.host, "port": a.port, "data_dir": a.data_dir,
                                               "metrics_port": a.metrics_port})
        cfg.check_tls_files()
    except (OSError, ValueError) as e:
        print(f"kvcraft serve: bad configuration: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    import uvloop

    from kvservice.server import serve as run_server

    def ready(running) -> None:  # noqa: ANN001 - RunningServer
        # One parseable line: tests and scripts wait for it (port 0 picks a free port).
        line = (f"kvcraft serving on {cfg.host}:{running.port} data_dir={cfg.data_dir}"
                + (f" metrics_port={running.metrics.port}" if running.metrics.port else ""))
        try:
            print(line, flush=True)
        except BrokenPipeError:  # nobody reads it (its reader gone): serve on, the line in the log
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # (the buffered line flushes there)
            os.close(devnull)
            logging.getLogger("kvcraft.serve").warning("stdout is closed: %s", line)

    from kvservice.datadir import DataDirInUse
    from kvservice.errors import disk_full
    from kvservice.metadata import MetadataDamaged, MetadataDiskFull

    try:
        uvloop.run(run_server(cfg, on_ready=ready, parent=parent))
    except (MetadataDamaged, MetadataDiskFull, DataDirInUse) as e:
        print(f"kvcraft serve: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if disk_full(e):
            where = f": {e.filename}" if e.filename else ""
            print(f"kvcraft serve: the disk under data_dir {cfg.data_dir} is full ({e.strerror}{where}); nothing "
                  "was changed: free space on it, or give another --data-dir", file=sys.stderr)
            return 2
        if e.filename and str(e.filename).startswith(str(cfg.data_path)):  # e.g. a file where the dir should be
            print(f"kvcraft serve: cannot use data_dir {cfg.data_dir}: {e.strerror}: {e.filename}", file=sys.stderr)
            return 2
        print(f"kvcraft serve: {e}", file=sys.stderr)
        return 1
    return 0


def repair(a: argparse.Namespace) -> int:
    """Move the metadata aside (never deleted) and rebuild it from the records the
    payload files carry; every payload whose record and layers verify comes back."""
    import shutil
    import time
    from pathlib import Path

    from kvservice.datadir import DataDirInUse, DataDirLock
    from kvservice.errors import disk_full
    from kvservice.metadata import MetadataDiskFull
    from kvservice.store import ChunkStore

    try:
        cfg = load_config(a.config, overrides={"data_dir": a.data_dir})
    except (OSError, ValueError) as e:
        print(f"kvcraft repair: bad configuration: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    meta = cfg.data_path / "metadata"
    if not (cfg.data_path / "payloads").is_dir():
        print(f"kvcraft repair: {cfg.data_path} has no payloads directory: nothing to rebuild from", file=sys.stderr)
        return 2
    try:  # before anything moves: a live service's metadata is in use, not damaged
        lock = DataDirLock.acquire(cfg.data_path, role="kvcraft repair")
    except DataDirInUse as e:
        print(f"kvcraft repair: refused, nothing was changed: {e}", file=sys.stderr)
        return 2
    aside = None
    if meta.exists():
        aside = Path(f"{meta}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        meta.rename(aside)
        print(f"kvcraft repair: moved the old metadata to {aside}")
    try:
        store = ChunkStore(cfg, repair=True, data_dir_lock=lock)
    except Exception as e:
        if not (isinstance(e, MetadataDiskFull) or disk_full(e)):
            raise
        # Undone: the rebuild this run began goes, the old metadata comes back where it was.
        shutil.rmtree(meta, ignore_errors=True)
        back = ""
        if aside is not None:
            aside.rename(meta)
            back = f", and the old metadata is back in {meta}"
        print(f"kvcraft repair: the disk under {cfg.data_path} is full: nothing was rebuilt{back}; free space on "
              "that disk and run it again", file=sys.stderr)
        return 2
    rep = store.recovery
    store.close()
    print(f"kvcraft repair: {rep.variants} variants rebuilt from their payload files; "
          f"{rep.orphan_payloads} files describe no variant and are in {cfg.data_path / 'lost+found'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
