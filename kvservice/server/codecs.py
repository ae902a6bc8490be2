"""How requests and responses become bytes: services registered with parsers that turn
bytes that are not the request type into INVALID_ARGUMENT, and the byte paths' own
codecs (`kvcraft.codec`: a Store layer as views of the received message, FetchLayers
responses serialized by the handler)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from kvcraft import codec
from kvcraft.codec import StoreLayer
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.errors import InvalidArgument


@dataclass(frozen=True)
class Malformed:
    """What the deserializer hands a handler for bytes that are not the request type:
    the handler answers INVALID_ARGUMENT (grpcio would answer UNKNOWN and log a
    traceback per request)."""

    problem: str


def _parser(cls: type) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        msg = cls()
        try:
            msg.ParseFromString(data)
        except (DecodeError, RecursionError) as e:
            return Malformed(f"the request is not a valid {cls.DESCRIPTOR.full_name} message: {e}")
        return msg

    return parse


def _store_parser(data: bytes) -> Any:
    """Store stream messages: a layer as views of the received bytes (`kvcraft.codec`,
    no copy), anything else through protobuf."""
    return codec.decode_store_layer(data) or _STORE_REQUEST(data)


_STORE_REQUEST = _parser(pb.StoreRequest)
# Per method: (request deserializer, response serializer) that replace protobuf's.
# FetchLayers yields LayerChunk messages it serialized itself (`kvcraft.codec`).
_CODECS: dict[str, tuple[Callable[[bytes], Any] | None, Callable[[Any], bytes] | None]] = {
    "Store": (_store_parser, None),
    "FetchLayers": (None, bytes),
}


def as_message(req: Any) -> Any:
    """A Store stream message as protobuf (a codec view becomes a StoreRequest)."""
    if isinstance(req, StoreLayer):
        return pb.StoreRequest(layer=pb.LayerPayload(layer=req.layer, key=bytes(req.key), value=bytes(req.value)))
    return req


def check_parsed(request: Any) -> None:
    if isinstance(request, Malformed):
        raise InvalidArgument(request.problem)


def message_bytes(req: Any) -> int:
    """Bytes of one received Store stream message (for the discard bound)."""
    if isinstance(req, Malformed):
        return 0
    if isinstance(req, StoreLayer):
        return req.key.nbytes + req.value.nbytes
    return req.ByteSize()


def add_service(server: grpc.aio.Server, service: str, *servicers: Any) -> None:
    """Register `service` of kvcraft.proto: each method is served by the one servicer
    that defines it, with deserializers that turn bytes that do not parse into
    INVALID_ARGUMENT instead of UNKNOWN."""
    desc = pb.DESCRIPTOR.services_by_name[service]
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    handlers = {}
    for m in desc.methods:
        owners = [s for s in servicers if m.name in type(s).__dict__]
        if len(owners) != 1:
            raise TypeError(f"{desc.full_name}.{m.name} is served by {len(owners)} servicers; expected one")
        handlers[m.name] = make[(m.client_streaming, m.server_streaming)](
            getattr(owners[0], m.name),
            request_deserializer=_CODECS.get(m.name, (None,))[0] or _parser(GetMessageClass(m.input_type)),
            response_serializer=_CODECS.get(m.name, (None, None))[1] or GetMessageClass(m.output_type).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name, handlers),))
