"""Block pool and KV cache manager: a hypothesis state machine plus prefix-caching cases."""

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def make_request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=1000))


class KVCacheMachine(RuleBasedStateMachine):
    """Allocate / append / share / free / evict / abort / reset in any order."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=BS, enable_caching=True)
        self.live: dict[str, Request] = {}
        self.n = 0

    @rule(prefix=st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (9, 9, 9, 9)]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def add(self, prefix, tail):
        req = make_request(f"r{self.n}", list(prefix) + tail)
        self.n += 1
        hits, num_cached = self.kv.get_computed_blocks(req)
        assert num_cached % BS == 0 and num_cached < req.num_tokens
        if self.kv.allocate_slots(req, req.num_tokens - num_cached, hits) is None:
            assert req.request_id not in self.kv.req_to_blocks
            return
        req.num_computed_tokens = req.num_tokens
        self.live[req.request_id] = req
        assert len(self.kv.req_to_blocks[req.request_id]) == -(-req.num_tokens // BS)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.output_token_ids.append(token)
        before = list(self.kv.block_ids(req.request_id))
        if self.kv.allocate_slots(req, 1) is None:
            req.output_token_ids.pop()
            assert self.kv.block_ids(req.request_id) == before
            return
        req.num_computed_tokens += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(rid))

    @rule()
    def reset(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def refcounts_match_tables(self):
        owners = Counter()
        for rid, table in self.kv.req_to_blocks.items():
            ids = [b.block_id for b in table]
            assert len(ids) == len(set(ids)), "a block appears twice in one block table"
            owners.update(ids)
        for block in self.kv.pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == owners[block.block_id]
            in_free_queue = block.block_id in self.kv.pool._free
            assert in_free_queue == (block.ref_cnt == 0)
        assert set(self.kv.req_to_blocks) == set(self.live)

    @invariant()
    def hashed_blocks_hold_their_tokens(self):
        # every published hash maps to a block whose hash is that hash
        for h, block in self.kv.pool._cached.items():
            assert block.block_hash == h

    def teardown(self):
        for req in list(self.live.values()):
            self.kv.free(req)
        assert self.kv.pool.num_free_blocks == self.kv.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_shared_prefix_hits_full_blocks_only():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", range(11))  # blocks [0..3] [4..7] + 3 tokens
    hits, n = kv.get_computed_blocks(a)
    assert (hits, n) == ([], 0)
    kv.allocate_slots(a, 11)
    b = make_request("b", list(range(10)) + [99])  # shares 10 tokens = 2 full blocks
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == kv.block_ids("a")[:2]
    kv.allocate_slots(b, b.num_tokens - n, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("b")[:2]] == [2, 2]


def test_last_token_is_always_recomputed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(8))
    kv.allocate_slots(a, 8)
    kv.free(a)
    same = make_request("b", range(8))
    _, n = kv.get_computed_blocks(same)
    assert n == 4  # the second block would cover the last token, so it is recomputed


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    hit, n = kv.get_computed_blocks(make_request("a2", [1, 2, 3, 4, 9]))
    assert n == 4
    # a request needing every block evicts the cached ones
    big = make_request("big", range(100, 108))
    assert kv.allocate_slots(big, 8) is not None
    _, n = kv.get_computed_blocks(make_request("a3", [1, 2, 3, 4, 9]))
    assert n == 0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", range(5))
    assert kv.allocate_slots(a, 5) is not None
    b = make_request("b", range(10, 14))
    assert kv.allocate_slots(b, 4) is None
    assert kv.pool.num_free_blocks == 0 and "b" not in kv.req_to_blocks


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    a = make_request("a", range(6))
    kv.allocate_slots(a, 6)
    assert kv.get_computed_blocks(make_request("b", range(6))) == ([], 0)
    assert not kv.pool._cached
