"""The load gate in the TensorRT-LLM connector (``lower_tier_gate``): once the engine has measured
both rates, a Redis hit slower to read than to recompute is not promised — the request computes it
(exact output) while the promotion goes on for later requests; unmeasured, or with the gate off, it
is promised as before."""

from __future__ import annotations

import pytest
from first_hits_rig import HIT, Rig, engine, prompt_a
from test_trtllm_e2e import prompt

from kvdepot.integrations.load_gate import LoadGate
from kvdepot.integrations.tensorrt_llm.providers import current_engine, destroy_engine

pytestmark = pytest.mark.timeout(120)
PROMPT_B = prompt(1800, 1700)


def fast_recompute(eng) -> LoadGate:  # noqa: ANN001 - the runtime's Engine
    """The reader's gate, told its engine prefills 10^9 tokens/s (no read can beat that), on a
    clock that stands still from then on (the steps it sees add nothing)."""
    scheduler = eng.connector.scheduler
    now = [0.0]
    gate = LoadGate(scheduler._gate.enabled, 1, clock=lambda: now[0])
    gate.step(10**9)
    now[0] = 1.0
    gate.step(0)
    scheduler._gate = gate
    return gate


@pytest.mark.parametrize("enabled", [True, False], ids=["gate on", "gate off"])
def test_a_hit_slower_to_read_than_to_recompute_is_prefetched_not_promised(enabled, monkeypatch, redis_factory) -> None:
    monkeypatch.setenv("KVDEPOT_HOST_CAPACITY_GB", "0.003")
    monkeypatch.setenv("KVDEPOT_REMOTE_URL", redis_factory().url)
    monkeypatch.setenv("KVDEPOT_LOWER_TIER_GATE", str(enabled).lower())
    monkeypatch.delenv("KVDEPOT_LOWER_TIER_HITS", raising=False)
    writer = engine(Rig())
    computed = {name: writer.generate([p], 4)[0] for name, p in (("a", prompt_a()), ("b", PROMPT_B))}
    destroy_engine()  # drains write-behind to Redis

    rig = Rig()
    eng = engine(rig)
    gate = fast_recompute(eng)
    first = eng.generate([PROMPT_B], 4)[0]  # no promotion has finished yet: the read rate is unknown
    assert rig.promised[0] == (HIT, False) and first.output_ids == computed["b"].output_ids
    second = eng.generate([prompt_a()], 4)[0]  # now it is known, and slower than 10^9 tokens/s
    assert second.error is None and second.output_ids == computed["a"].output_ids
    if enabled:
        assert rig.promised[1] == (0, False) and second.num_connector_matched_tokens == 0  # computed
        assert gate.refused == 1
        depot = current_engine()
        depot._promotions.wait_all(30)
        keys = depot.chunk_keys(prompt_a())
        assert depot.probe(keys).host_tokens == HIT  # prefetched for later requests
    else:
        assert rig.promised[1] == (HIT, False) and second.num_connector_matched_tokens == HIT
        assert gate.refused == 0
    current_engine().lower.flush()  # a chunk written behind is pinned while it is written
    stats = current_engine().stats()
    assert stats.live_leases == 0 and stats.pinned_chunks == 0
