"""gRPC adapter around the store: KVCache + Admin services, health, reflection, auth.

Servicers are thin: validate the shape of a request, call the store in a worker thread
(its I/O blocks), map domain errors to status codes in one place (`status.rpc`).

  codecs.py   registration of the services with lenient parsers (bytes that do not parse
              are INVALID_ARGUMENT) and the per-method codecs of the byte paths
  status.py   domain error -> status code (`rpc`), a full disk, running-RPC count (drain)
  checks.py   bounds of requests the store and planner do not know (ttl, timings, limits)
  peers.py    which clients share this host (offered shared memory: Locate, StoreLocal)
  data.py     the byte paths: Store, StoreLocal and FetchLayers
  lookup.py   finding and holding variants: Plan, Lookup, MatchPrefix, Locate, Lease, Release
  admin.py    the Admin service
  startup.py  start_server (options, auth, TLS, health, reflection), serve and the SIGTERM drain
"""

from kvservice.server.startup import RunningServer, serve, start_server

__all__ = ["RunningServer", "serve", "start_server"]
