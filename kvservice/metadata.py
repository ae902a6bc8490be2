"""Variant metadata in RocksDB (through rocksdict; docs/storage.md says why not rocksdb-py).

Column family "variants": variant id (ascii) -> serialized kvcraft.v1.VariantInfo (the
protobuf message is the on-disk format only: records in memory are `index.Variant`).
Column family "meta": format version. Writes that make or drop a variant are one
WriteBatch with sync=True; fr / last-access updates are unsynced (losing the last
few on a crash only makes eviction slightly less informed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.index import Variant
from kvservice.wire import variant_message

FORMAT_VERSION = b"1"
_CFS = ("variants", "meta")


class MetadataDB:
    def __init__(self, path: Path) -> None:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        self._db = Rdict(str(path), opts, column_families={cf: Options(raw_mode=True) for cf in _CFS})
        self._variants = self._db.get_column_family("variants")
        self._meta = self._db.get_column_family("meta")
        self._variants_h = self._db.get_column_family_handle("variants")
        self._sync = WriteOptions()
        self._sync.sync = True
        self._nosync = WriteOptions()
        version = self._meta.get(b"format")
        if version is None:
            self._meta.put(b"format", FORMAT_VERSION, self._sync)
        elif version != FORMAT_VERSION:
            raise RuntimeError(f"{path}: metadata format {version!r}, this build reads {FORMAT_VERSION!r}")

    def load_variants(self) -> Iterator[pb.VariantInfo]:
        """Stored records as messages; recovery validates them (`decode`) before use."""
        for _, raw in self._variants.items():
            info = pb.VariantInfo()
            info.ParseFromString(raw)
            yield info

    def put_variants(self, variants: Iterable[Variant], *, sync: bool) -> None:
        wb = WriteBatch(raw_mode=True)
        for v in variants:
            wb.put(v.variant_id.encode(), variant_message(v).SerializeToString(), self._variants_h)
        self._db.write(wb, self._sync if sync else self._nosync)

    def delete_variants(self, variant_ids: Iterable[str]) -> None:
        wb = WriteBatch(raw_mode=True)
        for vid in variant_ids:
            wb.delete(vid.encode(), self._variants_h)
        self._db.write(wb, self._sync)

    def close(self) -> None:
        self._variants.close()
        self._meta.close()
        self._db.close()

