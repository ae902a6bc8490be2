"""The `kvcraft` command (`kvcli.main`): the front over the service, the client, the
real model and the benchmarks, so that none of them depends on another's command."""
