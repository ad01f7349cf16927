"""The load gate in the vLLM connector (``lower_tier_gate``): once both rates are measured, a Redis
hit slower to read than to recompute is neither promised (``recompute`` policy) nor waited for
(``fail`` policy): the lookup offers the host part at once, and the promotion goes on, so the next
request with that prefix finds it in host memory."""

from __future__ import annotations

import pytest
from test_vllm_lower_tiers import HIT, IDS_A, NUM_BLOCKS, PROMPT, ask, finish, fresh, wait_loaded
from vllm_helpers import SKIP_REASON, VLLM_MISSING
from vllm_rig import Rig, engine, request, serve_miss

from kvdepot.bench.vllm import random_prompt
from kvdepot.integrations.load_gate import LoadGate
from kvdepot.integrations.vllm.providers import destroy_engine

pytestmark = [pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON), pytest.mark.timeout(120)]
OTHER = random_prompt(1800, seed=8)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_slow_lower_tier_hit_is_offered_as_its_host_part(tmp_path, redis_server, policy: str) -> None:
    (tmp_path / "a").mkdir()
    writer = Rig(tmp_path / "a", num_blocks=NUM_BLOCKS, seed=1, write_queue_depth=128, remote_url=redis_server.url)
    serve_miss(writer, "a", PROMPT, IDS_A)
    serve_miss(writer, "a2", OTHER, IDS_A)
    destroy_engine()  # write-behind drained to Redis; the next engine starts empty
    reader = fresh(tmp_path, remote_url=redis_server.url)
    req = ask(reader)  # unmeasured: promised as before (recompute policy), which measures the read rate
    assert wait_loaded(reader) == set()
    finish(reader, req, HIT)
    if policy == "fail":
        reader.sched._sched._lower = "wait"  # vLLM's default policy: the lookup would wait for the promotion
    now = [0.0]
    gate = LoadGate(True, 1, clock=lambda: now[0])
    gate.step(10**9)  # an engine that prefills 10^9 tokens/s: no read beats it
    now[0] = 1.0
    gate.step(0)
    reader.sched._sched._gate = gate
    other = request("r2", OTHER)
    assert reader.sched.get_num_new_matched_tokens(other, 0) == (0, False)  # not promised, not waited for
    assert gate.refused == 1
    assert [e["recompute_faster"] for e in reader.events("lookup")] == [False, True]
    reader.sched.request_finished(other, [])
    depot = engine()
    depot._promotions.wait_all(30)
    assert depot.probe(depot.chunk_keys(OTHER)).host_tokens == HIT  # prefetched for the next request
    depot.lower.flush()  # a chunk written behind is pinned while it is written
    assert depot.stats().live_leases == 0
