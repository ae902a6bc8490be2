from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.planner.conversation import ChunkMap, dedup


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


turns = st.lists(st.lists(st.sampled_from("abcdefgh"), max_size=6), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["c1", "c2", ""]), st.lists(st.sampled_from("abcdefgh"), max_size=6)),
                max_size=12))
def test_dedup_never_drops_a_chunk_not_sent_earlier_in_same_conversation(stream):
    cm = ChunkMap(ttl_s=100.0, clock=FakeClock())
    sent: dict[str, list[str]] = {}  # brute-force reference: everything each conv sent
    for conv, keys in stream:
        hist = cm.history(conv)
        kept, dropped = dedup(keys, hist or ())
        earlier = sent.get(conv, []) if conv else []
        # brute force: occurrence i of k is kept iff k was not sent before it
        expected_kept = [k for i, k in enumerate(keys) if k not in earlier and k not in keys[:i]]
        assert kept == expected_kept
        assert set(kept) | set(dropped) == set(keys) and len(kept) + len(dropped) == len(keys)
        assert len(set(kept)) == len(kept)
        assert set(kept).isdisjoint(earlier)
        cm.record(conv, kept)
        if conv:
            sent.setdefault(conv, []).extend(kept)


def test_second_turn_drops_only_chunks_of_earlier_turns():
    # CRAFT §4.3 example: turn 1 [C1, C2, C3], turn 2 [C2, C3, C4] -> only C4.
    cm = ChunkMap(clock=FakeClock())
    cm.record("conv", ["C1", "C2", "C3"])
    kept, dropped = dedup(["C2", "C3", "C4"], cm.history("conv"))
    assert kept == ["C4"] and dropped == ["C2", "C3"]
    assert dedup(["C2", "C4"], cm.history("other") or ()) == (["C2", "C4"], [])


def test_history_expires_after_ttl_without_sleeping():
    clock = FakeClock()
    cm = ChunkMap(ttl_s=10.0, clock=clock)
    cm.record("conv", ["a", "b"])
    clock.t = 9.0
    assert list(cm.history("conv")) == ["a", "b"]
    cm.record("conv", ["c"])  # refreshes the TTL
    clock.t = 18.5
    assert cm.history("conv") == {"a": 0, "b": 1, "c": 2}
    clock.t = 19.0
    assert cm.history("conv") is None
    assert len(cm) == 0


def test_least_recent_conversation_is_forgotten_at_capacity():
    cm = ChunkMap(clock=FakeClock(), max_conversations=2)
    for c in ("x", "y", "z"):
        cm.record(c, ["a"])
    assert cm.history("x") is None and cm.history("z") == {"a": 0}


def test_empty_conversation_id_has_no_history():
    cm = ChunkMap(clock=FakeClock())
    cm.record("", ["a"])
    assert cm.history("") is None


def test_a_conversation_holds_little_memory_however_long_its_id():
    """A client may name a conversation with megabytes: 200 of 100 KB ids are held in a small
    fraction of their 20 MB, and each still has its own history (ids that differ only in their
    last character are two conversations; an id equal to another's digest is a third)."""
    import hashlib
    import tracemalloc

    def conv_id(i: int) -> str:  # made anew each time, as each request's is
        return f"{'x' * 100_000}{i}"

    cm = ChunkMap(clock=FakeClock())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            cm.record(conv_id(i), [f"c{i}"])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1_000_000, held
    ids = [conv_id(i) for i in range(200)]
    assert all(cm.history(conv) == {f"c{i}": 0} for i, conv in enumerate(ids))
    assert cm.history("x" * 100_000) is None
    digest = hashlib.blake2b(ids[0].encode(), digest_size=16)
    assert cm.history(digest.hexdigest()) is None and cm.history(digest.digest().decode("latin-1")) is None
    cm.forget(ids[0])
    assert cm.history(ids[0]) is None and cm.history(ids[1]) == {"c1": 0}
