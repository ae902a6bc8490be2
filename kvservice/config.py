"""Settings of the service: embedded defaults < TOML file < KVCRAFT_* env vars < flags.

Validated once, here, at the edge; the rest of the service trusts a `Config`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import ssl
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from kvcraft.recompute import DEFAULT_BUDGET
from kvservice.fidelity import DEFAULT_SAMPLE as DEFAULT_FIDELITY_SAMPLE
from kvservice.fidelity import DEFAULT_TARGET as DEFAULT_FIDELITY_TARGET

# exit_with_parent: the pid of the process that starts `kvcraft serve`, where it says (`kvservice.launcher`):
# a starter gone before the service began is noticed too (`kvservice.cli.starter_pid`)
STARTER_PID_ENV = "KVCRAFT_STARTER_PID"

GiB = 1 << 30
MiB = 1 << 20
MIN_MESSAGE_BYTES = MiB  # max_message_bytes below this refuses Plans of a few hundred chunks
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port (the bound port is logged)
    data_dir: str = "./kvcraft-data"
    # Tier budgets in bytes. Every acknowledged variant is durable on disk; host holds
    # copies of the hottest ones (docs/storage.md: inclusive tiers).
    host_budget_bytes: int = 1 * GiB
    disk_budget_bytes: int = 64 * GiB
    # GPU tier (docs/gpu.md): a CUDA memory pool of this many bytes on gpu_device, above
    # host; 0 = off. Needs a CUDA driver; without one the service runs without it.
    gpu_budget_bytes: int = 0
    gpu_device: int = 0
    # How payloads are read from disk into GPU memory: "posix" (read, then one copy up)
    # or "kvikio" (GPUDirect Storage, or kvikio's compat mode; pip install 'kvcraft[gpu]').
    disk_backend: str = "posix"
    # Cache-Craft §3.3: at most M variants per chunk and N x M in all.
    max_variants_per_chunk: int = 4
    max_variants: int = 1_000_000
    # Limits on requests.
    max_message_bytes: int = 64 * MiB  # at least MIN_MESSAGE_BYTES
    max_layers: int = 512
    max_chunk_tokens: int = 65_536
    max_variant_bytes: int = 4 * GiB
    # Memory open Store streams may hold, all together: layers go to the payload file as
    # they arrive, so a stream holds about the layer it is receiving and the one read
    # ahead, and is counted at four layers (at most its payload); a Store beyond this gets RESOURCE_EXHAUSTED
    # (docs/operations.md).
    max_inflight_store_bytes: int = 1 * GiB
    # Co-located Stores (StoreLocal): a client on this host, in this pid namespace and
    # user, writes layers into a staging area of its own shared memory, which the service
    # maps read-only, instead of sending them over gRPC (docs/storage.md). Off: StoreLocal
    # answers FAILED_PRECONDITION and clients use the gRPC Store stream.
    local_store: bool = True
    max_fetch_variants: int = 256
    lease_timeout_s: float = 30.0
    # Longest lease a request may ask for (Lease ttl_s, Locate / Plan lease_ttl_s).
    max_lease_ttl_s: float = 3600.0
    # Leases outstanding at once (Lease, Locate, Plan): beyond it a new one is
    # RESOURCE_EXHAUSTED. Bounds the memory and the pinned variants of clients that take
    # leases and never release them (they end only by their ttl).
    max_leases: int = 100_000
    # A conversation remembers its last this-many chunks (CRAFT §4.3 dedup); bounds
    # the Plan response (history and per-chunk prefix keys), however long the talk.
    max_conversation_chunks: int = 512
    # Cache-Craft eq. 12-13: CFO = alpha * CCI * (1 - beta') <= alpha: the most of a chunk
    # recomputed (planner.variants.DEFAULT_ALPHA, the default recompute budget); set
    # against answer quality.
    cfo_alpha: float = DEFAULT_BUDGET
    # Fidelity on live traffic (docs/quality.md): the share of an adaptive engine's requests
    # whose first token must agree with full prefill's; the controller sets each model's
    # recompute budget to hold it (0: no controller, engines spend budgets of their own).
    fidelity_target: float = DEFAULT_FIDELITY_TARGET
    # Share of requests measured against full prefill once a model's budget is settled
    # (every request is measured while it is not, and a model's first FIRST_SAMPLES).
    fidelity_sample: float = DEFAULT_FIDELITY_SAMPLE
    # Prometheus metrics over HTTP on this port; 0 = off.
    metrics_port: int = 0
    # Bearer tokens; empty = no auth. Admin RPCs need admin_token when it is set.
    auth_token: str = ""
    admin_token: str = ""
    # TLS: server certificate and key (PEM paths); client CA for mTLS. Empty = plaintext.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    log_level: str = "INFO"
    # Seconds a SIGTERM waits for in-flight RPCs before stopping.
    drain_s: float = 5.0
    # Drain and stop, as on SIGTERM, once the process that started the service has exited
    # (checked every second): for services started by another program (the launcher of
    # tests, benchmarks and the demo) that must not outlive it when it is killed.
    exit_with_parent: bool = False
    # Remote tier (docs/scale-out.md): a Mooncake Store cluster shared by kvcraft nodes.
    # Off while remote_master is empty. In a TOML file the [remote] table sets these
    # without the prefix (master = "10.0.0.5:50051").
    remote_master: str = ""  # host:port of mooncake_master
    remote_protocol: str = "tcp"  # tcp | rdma
    remote_device: str = ""  # RDMA device names (rdma only), e.g. "mlx5_0"
    # Address other nodes reach this node's segment at; "" = the address this host sends
    # from to reach remote_master (its route's source address).
    remote_local_hostname: str = ""
    remote_segment_bytes: int = 1 * GiB  # host memory this node contributes to the cluster
    remote_buffer_bytes: int = 64 * MiB  # the Mooncake client's transfer buffer
    remote_budget_bytes: int = 64 * GiB  # payload bytes this node writes to the cluster
    remote_namespace: str = "kvcraft"  # key prefix: deployments sharing a cluster stay apart
    remote_list_slots: int = 8  # entries of a chunk's variant list in the cluster
    remote_write_through: bool = True  # copy each stored variant to the cluster at once
    # A transfer to or from another node's segment that makes no progress for this long
    # fails (the engine gets NOT_FOUND and recomputes), and that node's address is not
    # tried again for 10 s: a partitioned node costs a request this much, not TCP's minutes.
    remote_timeout_s: float = 2.0
    # This node's gRPC address in the cluster view; "" = host:port (with a wildcard host,
    # 0.0.0.0 or ::, the segment's address remote_local_hostname and the port).
    remote_advertise: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is outside 0..65535")
        for name in ("host_budget_bytes", "disk_budget_bytes", "max_message_bytes",
                     "max_layers", "max_chunk_tokens", "max_variant_bytes", "max_inflight_store_bytes",
                     "max_variants_per_chunk", "max_variants", "max_fetch_variants",
                     "max_leases", "max_conversation_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_message_bytes < MIN_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes must be >= {MIN_MESSAGE_BYTES:,} (a Plan of many chunks, a layer "
                             f"of a variant), got {self.max_message_bytes:,}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        object.__setattr__(self, "log_level", self.log_level.upper())  # (logging takes the upper-case names only)
        if self.gpu_budget_bytes < 0 or self.gpu_device < 0:
            raise ValueError(f"gpu_budget_bytes and gpu_device must be >= 0, got "
                             f"{self.gpu_budget_bytes} and {self.gpu_device}")
        if self.disk_backend not in ("posix", "kvikio"):
            raise ValueError(f"disk_backend must be \"posix\" or \"kvikio\", got {self.disk_backend!r}")
        if self.cfo_alpha < 0:
            raise ValueError(f"cfo_alpha must be >= 0, got {self.cfo_alpha}")
        if not 0 <= self.fidelity_target < 1:
            raise ValueError(f"fidelity_target must be in [0, 1) (a share of requests; 1 can never be shown "
                             f"by samples), got {self.fidelity_target}")
        if not 0 <= self.fidelity_sample <= 1:
            raise ValueError(f"fidelity_sample must be a share in [0, 1], got {self.fidelity_sample}")
        if not 0 < self.lease_timeout_s <= self.max_lease_ttl_s < math.inf:
            raise ValueError(f"need 0 < lease_timeout_s ({self.lease_timeout_s}) <= max_lease_ttl_s "
                             f"({self.max_lease_ttl_s}), both finite")
        if not 0 <= self.drain_s < math.inf:
            raise ValueError(f"drain_s must be finite and >= 0, got {self.drain_s}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key: "
                             "client certificates are only checked on a TLS server")
        if self.remote_protocol not in ("tcp", "rdma"):
            raise ValueError(f"remote_protocol must be tcp or rdma, got {self.remote_protocol!r}")
        for name in ("remote_segment_bytes", "remote_buffer_bytes", "remote_budget_bytes", "remote_list_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.remote_timeout_s <= 600:
            raise ValueError(f"remote_timeout_s must be within 1..600 seconds, got {self.remote_timeout_s}")
        if self.remote_master and ":" not in self.remote_master:
            raise ValueError(f"remote_master must be host:port, got {self.remote_master!r}")
        if self.remote_master and not _loopback(self.remote_master.rpartition(":")[0]):
            # A cluster across hosts: a loopback address would send the other nodes to themselves.
            for name in ("remote_local_hostname", "remote_advertise"):
                value = getattr(self, name)
                if value and _loopback(value.rpartition(":")[0] if name == "remote_advertise" else value):
                    raise ValueError(f"{name} {value!r} is a loopback address, but remote_master "
                                     f"{self.remote_master!r} is not: the other nodes could not reach this "
                                     f"node there; set this host's address on the cluster network (or leave "
                                     f"{name} empty to derive it)")

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir)

    def check_tls_files(self) -> None:
        """Read the TLS files once before serving, so a bad one is named, not reported
        as a failure to bind the address."""
        if not self.tls_cert:
            return
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"{name} {path!r} is not a readable file")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except ssl.SSLError as e:
            if "KEY_VALUES_MISMATCH" in str(e):
                raise ValueError(f"tls_key {self.tls_key!r} does not match the certificate in "
                                 f"tls_cert {self.tls_cert!r}") from None
            raise ValueError(f"tls_cert {self.tls_cert!r} / tls_key {self.tls_key!r} cannot be loaded "
                             f"as a PEM certificate and private key: {e.reason or e}") from None
        if self.tls_client_ca:
            try:
                ctx.load_verify_locations(self.tls_client_ca)
            except ssl.SSLError as e:
                raise ValueError(f"tls_client_ca {self.tls_client_ca!r} holds no PEM CA certificate: "
                                 f"{e.reason or e}") from None

    def to_toml(self) -> str:
        """Effective settings as TOML, secrets masked."""
        lines = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("auth_token", "admin_token") and v:
                v = "***"
            lines.append(f"{f.name} = {_toml_value(v)}")
        return "\n".join(lines) + "\n"


def _loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: resolved where it is used
        return False


def load_config(
    file: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Merge defaults, a TOML file, KVCRAFT_* env vars and explicit overrides (flags)."""
    env = os.environ if env is None else env
    types = {f.name: f.type for f in fields(Config)}
    merged: dict[str, Any] = {}
    if file:
        try:
            with open(file, "rb") as fh:
                doc = tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{file}: not TOML: {e}") from None
        doc = doc.get("kvcraft", doc)  # allow a [kvcraft] table or top-level keys
        remote = doc.pop("remote", {})
        if not isinstance(remote, dict):
            raise ValueError(f"{file}: remote must be a table ([remote])")
        doc.update({f"remote_{k}": v for k, v in remote.items()})
        for k, v in doc.items():
            if k not in types:
                raise ValueError(f"{file}: unknown setting {k!r}")
            merged[k] = v
    for k in types:
        ev = env.get(f"KVCRAFT_{k.upper()}")
        if ev is not None:
            merged[k] = _parse(k, ev, types[k])
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k not in types:
            raise ValueError(f"unknown setting {k!r}")
        merged[k] = v
    for k, v in merged.items():
        merged[k] = _coerce(k, v, types[k])
    return Config(**merged)


def _parse(name: str, raw: str, typ: str) -> Any:
    return _coerce(name, raw, typ)


def _coerce(name: str, v: Any, typ: str) -> Any:
    try:
        if typ == "int":
            return int(v)
        if typ == "float":
            return float(v)
        if typ == "bool":
            return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
        return str(v)
    except (TypeError, ValueError):
        raise ValueError(f"setting {name}: cannot read {v!r} as {typ}") from None


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def replace(cfg: Config, **changes: Any) -> Config:
    return dataclasses.replace(cfg, **changes)
