"""KVClient.plan answers a `kvcraft.plans.Plan` record, converted from the wire's
PlanResponse by one function (kvclient.messages.plan_of): every field of the message
has its field in the record, with the same value; the record decodes its key chains as
the message does, and crosses a process boundary (the vLLM connector pickles it)."""

from __future__ import annotations

import dataclasses
import pickle

from kvclient.messages import plan_of
from kvcraft.plans import ChunkPlan, KeyChain, Plan, Source, prefix_keys, variant_prefixes
from kvcraft.v1 import kvcraft_pb2 as pb

K = [f"{i:032x}" for i in range(6)]


def response() -> pb.PlanResponse:
    """A response with every field set (two chunks: a reused one, a fresh one)."""
    return pb.PlanResponse(
        order=[K[2], K[3]], dropped=[K[4]], history=[K[0]], other_keys=[K[5]],
        chunks=[pb.ChunkPlan(chunk_key=K[2], position=0, token_start=0, token_count=7, source=pb.ChunkPlan.VARIANT,
                             variant_id="v" * 32, tier="host", cfo=0.25, recompute=[3, 1, 4],
                             variant_prefix_chain=1, variant_prefix_length=2),
                pb.ChunkPlan(chunk_key=K[3], position=1, token_start=7, token_count=5, source=pb.ChunkPlan.FRESH)],
        variant_prefixes=[pb.KeyChain(ranges=[3, 1, 0, 1])],  # other_keys[0] (table index 3), then history[0]
        ratio=0.5, preload_depth=3, load_s_per_layer=0.001, compute_s_per_layer=0.002, lease_id="lease",
        lease_expires_unix_ms=1234, computed_tokens=8)


def _names(record: type) -> set[str]:
    return set(record._fields) if hasattr(record, "_fields") else {f.name for f in dataclasses.fields(record)}


def test_the_records_mirror_every_field_of_the_messages():
    """A field added to the proto fails here until the record (and plan_of) carry it."""
    for message, record in ((pb.PlanResponse, Plan), (pb.ChunkPlan, ChunkPlan), (pb.KeyChain, KeyChain)):
        assert {f.name for f in message.DESCRIPTOR.fields} == _names(record), record.__name__
    assert {v.name: v.number for v in pb.ChunkPlan.Source.DESCRIPTOR.values} == \
        {("SOURCE_" if s is Source.UNSPECIFIED else "") + s.name: s.value for s in Source}


def test_plan_of_keeps_every_value():
    r = response()
    plan = plan_of(r)
    for f in pb.PlanResponse.DESCRIPTOR.fields:
        if f.name not in ("chunks", "variant_prefixes"):
            want = getattr(r, f.name)
            assert getattr(plan, f.name) == (tuple(want) if f.is_repeated else want), f.name
    for cp, got in zip(r.chunks, plan.chunks, strict=True):
        for f in pb.ChunkPlan.DESCRIPTOR.fields:
            want = getattr(cp, f.name)
            assert getattr(got, f.name) == (tuple(want) if f.is_repeated else want), f.name
    assert plan.variant_prefixes == (KeyChain((3, 1, 0, 1)),)
    assert plan.chunks[0].source is Source.VARIANT and plan.chunks[0].reused
    assert plan.chunks[1].source is Source.FRESH and not plan.chunks[1].reused
    assert plan.chunks[0].source == pb.ChunkPlan.VARIANT  # the wire's numbers


def test_the_record_decodes_its_keys_as_the_message_does():
    r = response()
    plan = plan_of(r)
    assert variant_prefixes(plan) == variant_prefixes(r) == [(K[5], K[0]), ()]
    for cp, mp in zip(plan.chunks, r.chunks):
        assert prefix_keys(plan, cp) == prefix_keys(r, mp)
    assert prefix_keys(plan, plan.chunks[1]) == [K[0], K[2]]


def test_a_source_this_client_does_not_know_reads_as_unspecified():
    r = response()
    r.chunks[1].source = 7  # a value a newer service might send (proto3 enums are open)
    assert plan_of(r).chunks[1].source is Source.UNSPECIFIED


def test_the_record_pickles_whole():
    """The vLLM connector's scheduler side hands the Plan to its workers inside the
    connector metadata, which vLLM pickles."""
    plan = plan_of(response())
    assert pickle.loads(pickle.dumps(plan)) == plan
