"""Scale-out: kvcraft nodes sharing chunk KV through a Mooncake Store cluster.

- `mooncake`: the client wrapper (error codes -> domain errors, buffers -> addresses).
- `master`: `MasterProcess`, a `mooncake_master` on loopback for tests, benches and docs.
- `records`: the self-describing, checksummed payload object and the variant record.
- `view`: the per-chunk variant list and the global chunk-prefix view (CRAFT's global
  CP-Tree across nodes; each node's planner keeps its local tree).
- `silence`: the segments that stopped answering reads (a node frozen or cut off),
  skipped until a probe of them answers.
- `watch`: whether the master answers and still holds this node's segment; when either
  comes back, the node puts its variants back (`kvservice.store.sync`).

The remote tier itself (`kvservice.tiers.remote`) speaks the store's tier protocol, and
the store's `kvservice.store.sync` adopts listed variants and writes through: both sit
above this package, which imports neither the store nor the tiers.
docs/scale-out.md explains the deployment.
"""
