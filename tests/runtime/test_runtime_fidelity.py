"""The runtime behaves like TensorRT-LLM 1.2 where the issue found it did not (reference §3-§8).

Strict connector config, the overlap scheduler's timing (request_finished one iteration late, the
2nd decode delta empty), prompt-only blocks at ``update_state_after_alloc`` and decode blocks one
at a time, the request freed while its blocks stay pinned, and which request object each call gets.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from runtime_fakes import Script, built_outputs, make_recording_connector, prompt, recording_engine

from kvdepot.errors import ConfigError
from kvdepot.runtime import (
    CppRequestView,
    Engine,
    KvCacheConfig,
    KvCacheConnectorConfig,
    LlmRequest,
    MainKvCacheConnectorConfig,
    TorchLlmArgs,
)

B = 32
NAMES = dict(connector_module="m", connector_scheduler_class="S", connector_worker_class="W")


_engine, _prompt, _outputs = recording_engine, prompt, built_outputs


# -- the connector config ---------------------------------------------------------------------


def test_connector_config_is_strict_keyword_only_with_three_fields():
    cfg = KvCacheConnectorConfig(**NAMES)
    assert (cfg.connector_module, cfg.connector_scheduler_class, cfg.connector_worker_class) == ("m", "S", "W")
    with pytest.raises(TypeError):
        KvCacheConnectorConfig("m", "S", "W")  # type: ignore[misc]
    with pytest.raises(ConfigError, match="server_url: Extra inputs are not permitted"):
        KvCacheConnectorConfig(**NAMES, server_url="ipc:///tmp/x.sock")
    with pytest.raises(ConfigError, match="connector_worker_class: Field required"):
        KvCacheConnectorConfig(connector_module="m", connector_scheduler_class="S")
    for bad in (3, None):
        with pytest.raises(ConfigError, match="connector_module: Input should be a valid string"):
            KvCacheConnectorConfig(**{**NAMES, "connector_module": bad})
    with pytest.raises(ConfigError, match="connector: Extra inputs"):
        KvCacheConnectorConfig.model_validate({**NAMES, "connector": "kvdepot"})
    assert not hasattr(cfg, "server_url")  # what a 1.2 connector's getattr finds


def test_mains_wider_config_is_an_explicit_opt_in():
    cfg = MainKvCacheConnectorConfig(**NAMES, server_url="ipc:///tmp/x.sock")
    assert cfg.server_url == "ipc:///tmp/x.sock" and cfg.connector is None
    assert MainKvCacheConnectorConfig(connector="lmcache").connector_module is None
    with pytest.raises(ConfigError, match="Extra inputs"):
        MainKvCacheConnectorConfig(**NAMES, url="x")


def test_cuda_graphs_and_spec_decoding_are_refused_with_a_connector():
    with pytest.raises(NotImplementedError, match="CUDA graphs are not supported"):
        _engine(Script(), cuda_graph_config=object())
    with pytest.raises(NotImplementedError, match="speculative decoding"):
        _engine(Script(), speculative_config=object())
    Engine("tiny", llm_args=TorchLlmArgs(cuda_graph_config=object()))  # no connector: allowed


# -- the overlap scheduler (1.2's default) ----------------------------------------------------


def test_overlap_counts_and_request_finished_after_the_last_forward():
    script = Script()
    engine = _engine(script)
    assert engine.overlap
    [res] = engine.generate([_prompt(48)], 8)
    steps = 8
    for name in ("build_connector_meta", "start_load_kv", "wait_for_save", "forward_pass_callable"):
        assert script.count(name) == steps, name
    assert script.count("get_finished") == steps + 1  # the extra iteration hands the finish over
    names = script.names()
    # The last forward's wait_for_save, its own get_finished, and only then request_finished.
    assert names[-4:] == ["wait_for_save", "get_finished", "request_finished", "get_finished"]
    assert len(res.output_ids) == 8


def test_overlap_request_finished_comes_after_the_next_forward_was_issued():
    script = Script()
    engine = _engine(script)
    short = engine.submit(_prompt(40, 1), 2)
    long = engine.submit(_prompt(40, 2), 6)
    engine.run_until_done()
    names = script.names()
    at = names.index("request_finished")
    assert script.args("request_finished")[0][0] == short
    # The forward after the short request's last one ran before request_finished reached it.
    last_short_forward = 2  # prefill + 1 decode
    forwards_before = names[:at].count("wait_for_save")
    assert forwards_before == last_short_forward + 1
    assert set(engine.results) == {short, long}


def test_overlap_second_decode_delta_is_empty_and_later_deltas_catch_up():
    script = Script()
    [res] = _engine(script).generate([_prompt(48)], 6)
    outs = _outputs(script)
    deltas = [out.cached_requests[0].new_tokens for out in outs[1:]]
    assert deltas[0] == []  # the 1st sampled token has not reached the host yet
    seen = _prompt(48) + [t for d in deltas for t in d]
    assert seen == (_prompt(48) + res.output_ids)[: len(seen)]
    assert len(seen) == 48 + 6 - 2  # the last forward's input token is still one behind
    positions = [out.cached_requests[0].computed_position for out in outs[1:]]
    assert positions == [47 + k for k in range(len(positions))]  # len(visible tokens) - 1


@pytest.mark.parametrize("overlap", [True, False])
def test_prompt_blocks_at_alloc_and_decode_blocks_one_at_a_time(overlap):
    script = Script()
    [res] = _engine(script, disable_overlap_scheduler=not overlap).generate([_prompt(60)], 40)
    [(_, prompt_blocks)] = script.args("update_state_after_alloc")
    assert len(prompt_blocks) == 2  # ceil(60 / 32): nothing for the tokens to come
    outs = _outputs(script)
    assert outs[0].new_requests[0].new_block_ids == prompt_blocks
    decode = [out.cached_requests[0].new_block_ids for out in outs[1:]]
    assert all(len(d) <= 1 for d in decode) and sum(len(d) for d in decode) == 2  # positions 64, 96
    [(_, finished_blocks)] = script.args("request_finished")
    assert finished_blocks == prompt_blocks + [b for d in decode for b in d]
    assert len(finished_blocks) == -(-(60 + 40 - 1) // B)
    assert len(res.output_ids) == 40


# -- async save: request freed, blocks pinned -------------------------------------------------


def test_async_save_frees_the_request_and_pins_its_blocks_until_reported():
    script = Script(finished_returns=True, save_delay_polls=2)
    engine = _engine(script)
    rid = engine.submit(_prompt(48), 3)
    while not script.args("request_finished"):
        engine.step()
    held = script.args("request_finished")[0][1]
    assert rid in engine.results  # answered at once: the response does not wait for the save
    assert all(r.request_id != rid for r in engine._active)
    assert all(engine.blocks.ref_count(b) == 1 for b in held)  # pinned
    engine.step()
    assert all(engine.blocks.ref_count(b) == 1 for b in held)
    engine.run_until_done()
    assert all(engine.blocks.ref_count(b) == 0 for b in held)
    assert [a for a in script.args("get_finished") if a != ([], [])] == [([rid], [])]


# -- the request objects ----------------------------------------------------------------------


def test_each_call_gets_the_request_object_1_2_gives_it():
    script = Script(finished_returns=False)
    _engine(script).generate([_prompt(40)], 2)
    kinds = {name: type(req) for name, req in script.requests}
    assert kinds == {"get_num_new_matched_tokens": CppRequestView, "update_state_after_alloc": LlmRequest,
                     "request_finished": LlmRequest}
    cpp = next(req for name, req in script.requests if name == "get_num_new_matched_tokens")
    with pytest.raises(AttributeError, match="py_request_id"):
        _ = cpp.py_request_id
    assert cpp.prompt_len == 40 and cpp.get_tokens(0)[:40] == _prompt(40)


def test_metadata_must_survive_the_broadcast_pickle():
    sched, worker = make_recording_connector(Script())

    class Unpicklable(sched):
        def build_connector_meta(self, scheduler_output):
            return lambda: None  # 1.2 MPI-broadcasts the metadata: this cannot be sent

    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(max_tokens=1024))
    engine = Engine("tiny", llm_args=llm_args, connector=(Unpicklable, worker))
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        engine.generate([_prompt(40)], 2)


# -- the warm-up (reference §5.1: PyExecutor warms up, then registers the pool) ---------------


def _warm_engine(script: Script, warmup: bool | None, model: str = "tiny") -> Engine:
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(max_tokens=4096))
    return Engine(model, llm_args=llm_args, connector=make_recording_connector(script), warmup=warmup)


def test_warm_up_runs_between_the_connector_and_the_pool_registration_and_calls_no_hook(monkeypatch):
    script, seen = Script(), []
    real = Engine.warm_up

    def recorded(self: Engine) -> None:
        seen.append(list(script.names()))  # the calls made before the warm-up
        real(self)
        seen.append(list(script.names()))

    monkeypatch.setattr(Engine, "warm_up", recorded)
    engine = _warm_engine(script, True)
    assert seen[0] == seen[1] == ["register_forward_pass_callable"]  # built, not yet registered
    assert script.names() == ["register_forward_pass_callable", "register_kv_caches"]
    assert engine.blocks.num_available() == engine.num_blocks  # the block manager never heard of it
    assert not engine.pool.any()  # nothing of it stays in the pool


def test_warm_up_is_on_by_default_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(Engine, "warm_up", lambda self: calls.append(self.device.type))
    _warm_engine(Script(), None)
    assert calls == []  # CPU: no one-time toll to pay (bench firsthit), and tests build many engines
    _warm_engine(Script(), True)
    assert calls == ["cpu"]


@pytest.mark.parametrize("model", ["tiny", "mla-tiny"])
def test_a_warmed_up_engine_answers_bit_for_bit_as_a_cold_one(model):
    warm, cold = _warm_engine(Script(), True, model), _warm_engine(Script(), False, model)
    prompts = [_prompt(70, 3), _prompt(33, 9)]
    for a, b in zip(warm.generate(prompts, 5), cold.generate(prompts, 5), strict=True):
        assert a.output_ids == b.output_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
