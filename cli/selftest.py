"""`kvcraft selftest`: prove the GPU data path on this host, in one command (docs/gpu.md).

    kvcraft selftest [--mib 256] [--repeat 5] [--dir D] [--json selftest.json] [--no-kernels]
    python -m kvcli.selftest ...     (the same)

1. What the host has: CUDA driver, torch CUDA, kvikio (GDS or compat mode).
2. Round trips, bit for bit, through every piece that can run here: the gpu tier pool
   (put, read back), the host slab pinned with cudaHostRegister, payload reads into GPU
   memory with kvikio and with POSIX, the layer copy stream.
3. GB/s into GPU memory per tier, each beside the limit measured in the same run on the
   same bytes: host slab -> GPU beside a pinned torch copy; disk -> GPU (kvikio) beside
   an O_DIRECT read of the same file; gpu tier -> an engine tensor beside a torch
   device-to-device copy.
4. The Triton kernels beside SDPA and torch (kvbench.engine.kernels), on the GPU.

What cannot run here is listed as SKIP with the reason. Exit status 1 if any check
FAILed, else 0. Nothing here is a number unless it was measured in this run.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvbench.common.args import count
from kvcli.selftest_report import (Rate, Report, Result, Skip, drop_cache, median_gbps, payload,  # noqa: F401
                                     print_report, torch_cuda)


class SelfTest:
    def __init__(self, nbytes: int, repeat: int, workdir: Path, driver: Any = None, kvikio: Any = None,
                 load_driver: bool = True) -> None:
        from kvservice.tiers import gpu_driver

        self.nbytes = nbytes
        self.repeat = repeat
        self.workdir = workdir
        self.driver = driver if driver is not None else (gpu_driver.load(0) if load_driver else None)
        self.driver_reason = gpu_driver.unavailable_reason() or "no CUDA driver"
        self.kvikio = kvikio
        self.report = Report()
        self.data = payload(nbytes)
        self.file = workdir / "payload.kv"
        self.file.write_bytes(self.data)

    def need_driver(self) -> Any:
        if self.driver is None:
            raise Skip(f"no CUDA driver ({self.driver_reason})")
        return self.driver

    def need_kvikio(self) -> Any:
        if self.kvikio is None:
            try:
                import kvikio
                import kvikio.defaults  # noqa: F401
            except Exception as e:  # noqa: BLE001 - ImportError or a library that will not load
                raise Skip(f"kvikio not usable ({type(e).__name__}: {e}); pip install 'kvcraft[gpu]'") from None
            self.kvikio = kvikio
        return self.kvikio

    # -- environment -----------------------------------------------------------------
    def environment(self) -> None:
        env: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                               "cpus": os.cpu_count(), "payload_bytes": self.nbytes}
        env["cuda_driver"] = "yes" if self.driver is not None else f"no ({self.driver_reason})"
        try:
            import torch

            env["torch"] = torch.__version__
            env["torch_cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "no"
        except ImportError:
            env["torch"] = "not installed"
        try:
            kv = self.need_kvikio()
            env["kvikio"] = getattr(kv, "__version__", "yes")
            env["kvikio_mode"] = "compat (no GDS)" if kv.defaults.is_compat_mode_preferred() else "GDS"
        except Skip as s:
            env["kvikio"] = str(s)
        self.report.environment = env

    # -- round trips -----------------------------------------------------------------
    def put(self, tier: Any) -> Any:
        """Store the payload in `tier` through the tier protocol, as one layer."""
        from kvservice.tiers.base import PayloadShape

        shape = PayloadShape(1, self.nbytes)
        w = tier.open_writer("selftest", shape)
        w.write_layer(self.data)
        w.commit()
        return shape

    def check_cpu_tiers(self) -> str:
        """The host slab and the disk tier through the same protocol as the gpu tier."""
        from kvservice.tiers.disk import DiskTier
        from kvservice.tiers.host import HostTier

        host = HostTier(self.nbytes, f"kvcraft-selftest-{os.getpid()}")
        disk = DiskTier(self.workdir / "tier", self.nbytes)
        try:
            for tier in (host, disk):
                shape = self.put(tier)
                if bytes(tier.get_layers("selftest", 0, 1, shape)) != self.data:
                    raise AssertionError(f"bytes read back from the {tier.name} tier differ")
        finally:
            host.close()
        return f"{self.nbytes} bytes bit-identical through host and disk"

    def check_store_path(self) -> str:
        """The service's own store with every tier this host runs (gpu + host + disk where
        CUDA is, host + disk elsewhere): store a chunk, fetch it twice (the first fetch
        promotes it to the fastest tier), compare every layer bit for bit."""
        from kvcraft.v1 import kvcraft_pb2 as pb
        from kvservice.config import load_config
        from kvservice.index import Spec
        from kvcraft.records import Ref
        from kvservice.records import StoreHeader
        from kvservice.store import ChunkStore
        from kvservice.tiers import build_tiers
        from kvcraft.keys import ModelSpec

        layers, heads, dim = 4, 8, 128
        tokens = max(1, self.nbytes // (layers * 2 * heads * dim * 2))  # fp16 K and V
        half = heads * tokens * dim * 2
        backend = "kvikio" if self.driver is not None and self.report.environment.get("kvikio_mode") else "posix"
        cfg = load_config(env={}, overrides={
            "data_dir": str(self.workdir / "store"), "host_budget_bytes": 4 * layers * 2 * half,
            "disk_budget_bytes": 8 * layers * 2 * half, "max_variant_bytes": 4 * layers * 2 * half,
            "gpu_budget_bytes": 4 * layers * 2 * half if self.driver is not None else 0,
            "disk_backend": backend})
        store = ChunkStore(cfg, tiers=build_tiers(cfg, "selftest", self.driver))
        try:
            model = ModelSpec("selftest", layers, heads, dim, "float16").fingerprint()
            spec = Spec(pb.FLOAT16, (heads, tokens, dim))
            data = [(self.data[:half].ljust(half, b"k"), self.data[-half:].rjust(half, b"v")) for _ in range(layers)]
            session = store.begin_store(StoreHeader(model, list(range(tokens)), (), layers, spec, spec))
            for i, (k, v) in enumerate(data):
                session.add_layer(i, k, v)
            key = session.finish().chunk_key
            for tier in store.tiers[:-1]:  # drop the copies above disk: the fetch starts there
                tier.delete(store.index.variants_of(key)[0].variant_id)
            served = []
            for _ in range(2):
                (v,) = store.open_fetch([Ref(key)])
                for i, (k, val) in enumerate(data):
                    # bytes() at once: a host-tier read is a view of the slab, which must not
                    # outlive the store
                    if [bytes(b) for b in store.read_layer(v, i)] != [k, val]:
                        raise AssertionError(f"layer {i} differs after a round trip through the store")
                store.close_fetch([v])
                served.append(store.index.variants_of(key)[0].tier)
        finally:
            store.close()
        names = " + ".join(t.name for t in store.tiers)
        return f"tiers {names} (disk reads into GPU: {backend if self.driver else 'n/a'}); promoted to {served[-1]}; bit-identical"

    def check_gpu_tier(self) -> str:
        drv = self.need_driver()
        from kvservice.tiers.gpu import GpuTier

        tier = GpuTier(self.nbytes * 2, drv)
        try:
            shape = self.put(tier)
            if bytes(tier.get_layers("selftest", 0, shape.num_layers, shape)) != self.data:
                raise AssertionError("bytes read back from the gpu tier differ")
            handle = tier.ipc_handle()
            return f"{self.nbytes} bytes bit-identical; IPC handle {len(handle)} bytes"
        finally:
            tier.close()

    def check_pinned_slab(self) -> str:
        drv = self.need_driver()
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(create=True, size=self.nbytes)
        try:
            addr = drv.host_register(shm.buf)
            try:
                shm.buf[:] = self.data
                dev = drv.alloc(self.nbytes)
                try:
                    drv.htod(dev, shm.buf)
                    back = bytearray(self.nbytes)
                    drv.dtoh(back, dev, self.nbytes)
                    if bytes(back) != self.data:
                        raise AssertionError("bytes copied from the pinned slab differ")
                    pinned = self._rate_host(drv, shm.buf, dev)
                finally:
                    drv.free(dev)
            finally:
                drv.host_unregister(addr)
        finally:
            shm.close()
            shm.unlink()
        return pinned

    def _rate_host(self, drv: Any, buf: memoryview, dev: int) -> str:
        gbps = median_gbps(self.nbytes, lambda: drv.htod(dev, buf), self.repeat)
        limit = None
        try:
            torch = torch_cuda()
            src = torch.frombuffer(bytearray(self.data), dtype=torch.uint8).pin_memory()
            dst = torch.empty(self.nbytes, dtype=torch.uint8, device="cuda")

            def torch_copy() -> None:
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()

            limit = median_gbps(self.nbytes, torch_copy, self.repeat)
        except Skip:
            pass
        self.report.rates.append(Rate("host slab (pinned) -> GPU", gbps, "pinned torch copy", limit))
        return f"bit-identical through cudaHostRegister'd shared memory; {gbps:.1f} GB/s"

    def check_disk_reads(self, backend_name: str) -> str:
        drv = self.need_driver()
        from kvservice.tiers.disk_backend import KvikioBackend, PosixBackend, aligned_window
        from kvservice.tiers.gpu_driver import DeviceBuffer

        backend = KvikioBackend(self.need_kvikio(), drv) if backend_name == "kvikio" else PosixBackend(drv)
        _, size = aligned_window(0, self.nbytes)
        dev = drv.alloc(size)
        try:
            spans = [(0, self.nbytes), (5000, min(7000, self.nbytes - 5000))] if self.nbytes > 12000 else [(0, self.nbytes)]
            for offset, length in spans:
                skew = backend.read_into_device(self.file, offset, length, DeviceBuffer(dev, size))
                back = bytearray(length)
                drv.dtoh(back, dev + skew, length)
                if bytes(back) != self.data[offset : offset + length]:
                    raise AssertionError(f"{backend_name}: bytes [{offset}, +{length}) differ")

            def read() -> None:
                backend.read_into_device(self.file, 0, self.nbytes, DeviceBuffer(dev, size))

            gbps = median_gbps(self.nbytes, read, self.repeat, before=lambda: drop_cache(self.file))
        finally:
            drv.free(dev)
        limit = self.o_direct_gbps()
        mode = ""
        if isinstance(backend, KvikioBackend):
            mode = " (compat mode)" if backend.compat_mode else " (GDS)"
        self.report.rates.append(Rate(f"disk -> GPU, {backend_name}{mode}", gbps, "O_DIRECT read to host", limit))
        return f"bit-identical; {gbps:.2f} GB/s"

    def o_direct_gbps(self) -> float | None:
        """The drive's limit for these bytes: an O_DIRECT read into page-aligned host memory."""
        if not hasattr(self, "_o_direct"):
            self._o_direct = None
            try:
                fd = os.open(self.file, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            except OSError:
                return None
            try:
                buf = mmap.mmap(-1, (self.nbytes + 4095) // 4096 * 4096)

                def read() -> None:
                    got = 0
                    while got < self.nbytes:
                        n = os.preadv(fd, [memoryview(buf)[got:]], got)
                        if n == 0:
                            break
                        got += n

                self._o_direct = median_gbps(self.nbytes, read, self.repeat)
            except OSError:  # tmpfs and some filesystems refuse O_DIRECT
                pass
            finally:
                os.close(fd)
        return self._o_direct

    def check_o_direct(self) -> str:
        gbps = self.o_direct_gbps()
        if gbps is None:
            raise Skip(f"the filesystem of {self.workdir} refuses O_DIRECT")
        return f"{gbps:.2f} GB/s into host memory (the drive's limit for the disk rows)"

    def check_copy_stream(self) -> str:
        torch = torch_cuda()
        from kvclient.copy_stream import LayerCopyStream

        g = torch.Generator().manual_seed(0)
        layers = {layer: {0: (torch.randn(8, 64, 128, generator=g).pin_memory(),
                              torch.randn(8, 64, 128, generator=g).pin_memory())} for layer in range(4)}
        copies = LayerCopyStream("cuda")
        for layer, kv in layers.items():
            copies.submit(layer, kv)
        for layer, kv in layers.items():
            got = copies.take(layer)
            if not (torch.equal(got[0][0].cpu(), kv[0][0]) and torch.equal(got[0][1].cpu(), kv[0][1])):
                raise AssertionError(f"layer {layer} differs after the side-stream copy")
        copies.close()
        return "4 layers bit-identical after side-stream copies and per-layer events"

    def check_gpu_tier_to_engine(self) -> str:
        drv = self.need_driver()
        torch = torch_cuda()
        from kvservice.tiers.gpu import GpuTier

        tier = GpuTier(self.nbytes, drv)
        try:
            self.put(tier)
            pool = torch.as_tensor(tier.device_span("selftest"), device="cuda")
            dst = torch.empty_like(pool)
            other = torch.empty_like(pool)

            def from_tier() -> None:
                dst.copy_(pool)
                torch.cuda.synchronize()

            def d2d() -> None:
                other.copy_(dst)
                torch.cuda.synchronize()

            gbps = median_gbps(self.nbytes, from_tier, self.repeat)
            limit = median_gbps(self.nbytes, d2d, self.repeat)
            if bytes(dst.cpu().numpy()) != self.data:
                raise AssertionError("bytes copied out of the gpu tier differ")
        finally:
            tier.close()
        self.report.rates.append(Rate("gpu tier -> engine tensor", gbps, "torch device-to-device copy", limit))
        return f"bit-identical; {gbps:.1f} GB/s"

    def kernels(self) -> str:
        torch = torch_cuda()
        from kvbench.engine import kernels

        rows = kernels.run(2500, 0.15, torch.bfloat16, 4.8e12, 990e12)
        kernels._print_table(rows)  # noqa: SLF001 - the benchmark's own table
        self.report.kernels = [asdict(r) for r in rows]
        return f"{len(rows)} rows, each checked against its reference first"

    def run(self, with_kernels: bool = True) -> Report:
        self.environment()
        r = self.report
        r.add("host + disk tiers: write, read back", self.check_cpu_tiers)
        r.add("store: every tier of this host, promote, read back", self.check_store_path)
        r.add("gpu tier: put, read back (driver API pool)", self.check_gpu_tier)
        r.add("host slab pinned (cudaHostRegister) -> GPU", self.check_pinned_slab)
        r.add("disk -> GPU, POSIX backend", lambda: self.check_disk_reads("posix"))
        r.add("disk -> GPU, kvikio backend", lambda: self.check_disk_reads("kvikio"))
        r.add("disk O_DIRECT read (drive limit)", self.check_o_direct)
        r.add("layer copy stream (side stream + events)", self.check_copy_stream)
        r.add("gpu tier -> engine tensor", self.check_gpu_tier_to_engine)
        if with_kernels:
            r.add("Triton kernels vs SDPA/torch (kvbench.engine.kernels)", self.kernels)
        return r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcraft selftest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=256, help="payload size for round trips and rates")
    parser.add_argument("--repeat", type=count(), default=5, help="timed repetitions (median)")
    parser.add_argument("--dir", type=Path, help="where the payload file goes (the drive to test); "
                                                 "default: a temporary directory")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument("--no-kernels", action="store_true", help="skip the Triton kernel benchmark")
    a = parser.parse_args(argv)
    nbytes = int(a.mib * 2**20)
    if nbytes <= 0 or a.repeat <= 0:
        print("kvcraft selftest: --mib and --repeat must be positive", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="kvcraft-selftest-") as d:
        report = SelfTest(nbytes, a.repeat, Path(d)).run(with_kernels=not a.no_kernels)
    print_report(report)
    if a.json:
        out = asdict(report)
        out["date_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        a.json.write_text(json.dumps(out, indent=2))
        print(f"\nwrote {a.json}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
