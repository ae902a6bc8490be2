"""kvcraft contract package: what the service, the client and the engine adapter share.

Everything here sits below the rest of the project and imports none of it (no torch,
no service, no client):

- `kvcraft.v1`: the wire contract, stubs generated from `kvcraft/v1/kvcraft.proto`;
- `kvcraft.keys`: identity (model fingerprint, chunk key, variant id);
- `kvcraft.records`: plain records both sides exchange (`VariantStats`);
- `kvcraft.layout`: a variant's payload layout (dtypes, shapes, byte offsets, checksums);
- `kvcraft.tiers`: the names of the storage tiers, fastest first.
"""
