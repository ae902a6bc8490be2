"""kvcraft client library (import name `kvclient`).

Identity (`ModelSpec`, `chunk_key`, `variant_id`) and shared records (`VariantStats`,
`Ref`, `StoreResult`, a Plan's answer `Plan`) live in the contract package `kvcraft`
(`kvcraft.keys`, `kvcraft.records`, `kvcraft.plans`); the clients load torch and grpc
on first use.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "KVClient": "kvclient.client",
    "AsyncKVClient": "kvclient.client",
    "Ref": "kvcraft.records",
    "StoreResult": "kvcraft.records",
    "FetchedLayer": "kvclient.messages",
    "Lease": "kvclient.messages",
    "Plan": "kvcraft.plans",
    "KVCraftError": "kvclient.errors",
    "NotFoundError": "kvclient.errors",
    "InvalidArgumentError": "kvclient.errors",
    "ResourceExhaustedError": "kvclient.errors",
    "FailedPreconditionError": "kvclient.errors",
    "UnavailableError": "kvclient.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvclient' has no attribute {name!r}")
