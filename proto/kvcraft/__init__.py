"""kvcraft wire contract: generated protobuf/gRPC stubs (see proto/kvcraft/v1/*.proto)."""
