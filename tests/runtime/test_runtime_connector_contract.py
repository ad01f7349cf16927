"""The executor drives a recording connector exactly as TensorRT-LLM's tests expect (reference §5-§7).

These run with the overlap scheduler off (``disable_overlap_scheduler=True``), where every call of
an iteration belongs to that iteration; ``test_runtime_overlap.py`` covers 1.2's default.
"""

from __future__ import annotations

import threading

import pytest
from runtime_fakes import Script, built_outputs, make_recording_connector, prompt, recording_engine

from kvdepot.runtime import Engine, KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs

B = 32
LAYERS = 2  # the tiny preset


def _engine(script: Script, max_tokens: int = 4096, **args) -> Engine:
    args.setdefault("disable_overlap_scheduler", True)  # these cases count steps without the overlap's lag
    return recording_engine(script, max_tokens, **args)


_prompt, _outputs = prompt, built_outputs


def test_simple_contract_counts_and_order():
    script = Script()
    engine = _engine(script)
    [res] = engine.generate([_prompt(48)], 32)
    steps = 32  # one prefill, 31 decodes
    assert script.args("register_kv_caches") == [((engine.num_blocks, LAYERS, 2, 2 * B * 16),
                                                  engine.pool.dtype)]
    assert script.count("register_forward_pass_callable") == 1
    assert script.args("get_num_new_matched_tokens") == [(res.request_id, 0)]
    [(rid, blocks)] = script.args("update_state_after_alloc")
    assert rid == res.request_id and len(blocks) == 2
    for name in ("build_connector_meta", "bind_connector_meta", "start_load_kv", "wait_for_save",
                 "forward_pass_callable", "get_finished"):
        assert script.count(name) == steps, name
    for name in ("wait_for_layer_load", "save_kv_layer"):
        assert [a[0] for a in script.args(name)] == list(range(LAYERS)) * steps
    assert all(a == ([], []) for a in script.args("get_finished"))
    [(rid, finished_blocks)] = script.args("request_finished")
    assert len(finished_blocks) == -(-(48 + 32) // B) == 3 and finished_blocks[:2] == blocks
    assert set(script.streams) == {None}  # CPU: no stream
    # One step, in TensorRT-LLM's order.
    first = script.names().index("build_connector_meta")
    assert script.names()[first : first + 10] == [
        "build_connector_meta", "bind_connector_meta", "start_load_kv",
        "wait_for_layer_load", "save_kv_layer", "wait_for_layer_load", "save_kv_layer",
        "forward_pass_callable", "wait_for_save", "get_finished",
    ]
    assert script.names().index("register_kv_caches") < script.names().index("get_num_new_matched_tokens")
    assert script.names()[-3:] == ["wait_for_save", "request_finished", "get_finished"]


def test_scheduler_output_shapes_prefill_and_decode():
    script = Script()
    [res] = _engine(script).generate([_prompt(48)], 32)
    outs = _outputs(script)
    first = outs[0]
    assert first.cached_requests == [] and len(first.new_requests) == 1
    new = first.new_requests[0]
    assert (len(new.new_tokens), len(new.new_block_ids), new.computed_position,
            new.num_scheduled_tokens) == (48, 2, 0, 48)
    assert new.new_tokens == _prompt(48)
    grown = []
    for k, out in enumerate(outs[1:]):
        assert out.new_requests == [] and len(out.cached_requests) == 1
        data = out.cached_requests[0]
        assert data.new_tokens == [res.output_ids[k]]
        assert data.computed_position == 48 + k and data.num_scheduled_tokens == 1
        assert len(data.new_block_ids) == (1 if data.computed_position % B == 0 else 0)
        grown += data.new_block_ids
    assert len(grown) == 1
    assert script.args("request_finished")[0][1] == new.new_block_ids + grown


def test_sync_connector_match_is_excluded_from_first_computed_position():
    script = Script(matched=(8, False))
    [res] = _engine(script).generate([_prompt(48)], 2)
    new = _outputs(script)[0].new_requests[0]
    assert new.computed_position == 0 and new.num_scheduled_tokens == 40
    assert res.num_connector_matched_tokens == 8


def test_chunked_context_reports_whole_prompt_then_empty_deltas():
    script = Script()
    _engine(script, max_num_tokens=128).generate([_prompt(256)], 2)
    first, second, third = _outputs(script)
    new = first.new_requests[0]
    assert (len(new.new_tokens), len(new.new_block_ids), new.computed_position,
            new.num_scheduled_tokens) == (256, 8, 0, 128)
    chunk = second.cached_requests[0]
    assert second.new_requests == []
    assert (chunk.new_tokens, chunk.new_block_ids, chunk.computed_position,
            chunk.num_scheduled_tokens) == ([], [], 128, 128)
    decode = third.cached_requests[0]
    assert decode.computed_position == 256 and len(decode.new_tokens) == 1
    assert decode.new_block_ids != []  # position 256 opens block 8
    assert script.count("update_state_after_alloc") == 1


@pytest.mark.parametrize("delay", [0, 2])
def test_async_onboard_parks_then_schedules_with_loaded_tokens(delay):
    script = Script(matched=(16, True), load_delay_polls=delay)
    [res] = _engine(script).generate([_prompt(48)], 4)
    steps = 4
    gf = script.args("get_finished")
    assert len(gf) == steps + 1 + delay
    assert gf[0] == ([], [res.request_id]) and all(a == ([], []) for a in gf[1:])
    outs = _outputs(script)
    # The parking iteration still builds metadata, from an empty output, and runs no forward.
    assert outs[0].new_requests == [] and outs[0].cached_requests == []
    assert script.count("wait_for_save") == steps
    assert len(outs) == steps + 1
    new = outs[1].new_requests[0]
    assert new.computed_position == 16 and new.num_scheduled_tokens == 32
    assert len(new.new_tokens) == 48 and len(new.new_block_ids) == 2
    assert script.count("update_state_after_alloc") == 1
    assert res.connector_async_load and res.num_connector_matched_tokens == 16


def test_async_save_holds_blocks_until_reported():
    script = Script(finished_returns=True, save_delay_polls=2)
    engine = _engine(script)
    rid = engine.submit(_prompt(48), 3)
    while rid not in engine.results:
        engine.step()
    held = script.args("request_finished")[0][1]
    # The finishing step's own poll passed the id; the worker reports it two polls later.
    assert script.args("get_finished")[-1] == ([rid], [])
    assert all(engine.blocks.ref_count(b) == 1 for b in held)
    engine.step()
    assert all(engine.blocks.ref_count(b) == 1 for b in held)
    engine.run_until_done()
    assert all(engine.blocks.ref_count(b) == 0 for b in held)
    gf = script.args("get_finished")
    assert [a for a in gf if a != ([], [])] == [([rid], [])]
    assert gf[-1] == ([], [])  # reported on a later poll, after the id was passed once


def test_async_save_frees_blocks_so_a_later_request_fits():
    # 4 blocks in all; each request needs 2 for 48 prompt tokens + 10 new ones.
    script = Script(finished_returns=True, save_delay_polls=1)
    engine = _engine(script, max_tokens=4 * B)
    results = engine.generate([_prompt(48, 1), _prompt(48, 2), _prompt(48, 3)], 10)
    assert [r.output_ids != [] for r in results] == [True] * 3
    passed = [rid for a in script.args("get_finished") for rid in a[0]]
    assert sorted(passed) == [r.request_id for r in results]
    # The third request is admitted only after the first two were passed to get_finished.
    names = [(n, a) for n, a in script.calls if n in ("get_finished", "get_num_new_matched_tokens")]
    third = names.index(("get_num_new_matched_tokens", (results[2].request_id, 0)))
    assert any(n == "get_finished" and a[0] for n, a in names[:third])
    assert engine.blocks.num_available() == 4


def test_connector_errors_raise():
    with pytest.raises(RuntimeError, match="load_kv_async must be False"):
        _engine(Script(matched=(0, True))).generate([_prompt(48)], 2)
    with pytest.raises(RuntimeError, match="prepopulatedPromptLen < promptLen"):
        _engine(Script(matched=(48, False))).generate([_prompt(48)], 2)
    _engine(Script(matched=(47, False))).generate([_prompt(48)], 2)  # one token left: fine


def test_device_reuse_reaches_connector_and_output():
    script = Script()
    engine = _engine(script)
    shared = _prompt(64)
    engine.generate([shared + [3, 4, 5]], 2)
    [res] = engine.generate([shared + [9, 9, 9, 9, 9, 9]], 2)
    assert script.args("get_num_new_matched_tokens")[1] == (res.request_id, 64)
    new = _outputs(script)[2].new_requests[0]
    assert new.computed_position == 64 and len(new.new_tokens) == 70 and len(new.new_block_ids) == 3
    assert new.num_scheduled_tokens == 6 and res.num_device_reused_tokens == 64


def test_concurrent_requests_share_steps():
    script = Script()
    results = _engine(script).generate([_prompt(48, 1), _prompt(20, 2), _prompt(70, 3)], 3)
    first = _outputs(script)[0]
    assert [len(d.new_tokens) for d in first.new_requests] == [48, 20, 70]
    assert script.count("build_connector_meta") == 3
    assert all(len(r.output_ids) == 3 for r in results)
    assert script.count("get_num_new_matched_tokens") == script.count("update_state_after_alloc") == 3


def test_connector_imported_by_name_and_constructed_concurrently(monkeypatch):
    import runtime_fakes

    barrier = threading.Barrier(2, timeout=10)  # sequential construction would break it
    script = Script(on_init=lambda who: barrier.wait())
    sched, worker = make_recording_connector(script)
    monkeypatch.setattr(runtime_fakes, "ImportedScheduler", sched, raising=False)
    monkeypatch.setattr(runtime_fakes, "ImportedWorker", worker, raising=False)
    cfg = KvCacheConnectorConfig(connector_module="runtime_fakes", connector_scheduler_class="ImportedScheduler",
                                 connector_worker_class="ImportedWorker")
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(max_tokens=1024), kv_connector_config=cfg)
    engine = Engine("tiny", llm_args=llm_args)
    engine.generate([_prompt(10)], 2)
    assert script.count("register_kv_caches") == 1 and script.count("build_connector_meta") == 2
    assert llm_args.model == "" and engine.llm_args.model == "tiny-random-seed0-cpu"  # caller's args untouched


def test_rejected_configurations():
    from kvdepot.runtime.llm_args import CapacitySchedulerPolicy, SchedulerConfig

    with pytest.raises(NotImplementedError, match="guaranteed no evict"):
        _engine(Script(), scheduler_config=SchedulerConfig(CapacitySchedulerPolicy.MAX_UTILIZATION))
    with pytest.raises(NotImplementedError):
        _engine(Script(), pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="enable_block_reuse"):
        Engine("tiny", llm_args=TorchLlmArgs(kv_cache_config=KvCacheConfig(enable_block_reuse=False)),
               connector=make_recording_connector(Script()))


def test_request_joining_mid_decode_is_new_while_the_other_is_cached():
    script = Script()
    engine = _engine(script)
    first = engine.submit(_prompt(40), 5)
    engine.step()
    second = engine.submit(_prompt(20, 3), 3)
    engine.step()
    out = _outputs(script)[1]
    assert [d.request_id for d in out.new_requests] == [second]
    assert [d.request_id for d in out.cached_requests] == [first]
    assert len(out.new_requests[0].new_tokens) == 20 and len(out.cached_requests[0].new_tokens) == 1
    engine.run_until_done()
    assert set(engine.results) == {first, second}
