"""Test doubles for the runtime: a recording connector and a tiny in-memory block-store connector.

``make_recording_connector`` returns fresh (scheduler, worker) classes that log every call with a
deep copy of its arguments into a ``Script``; the script also decides the answers (matched tokens,
async save) and after how many ``get_finished`` polls the worker reports an id back.

``make_block_store_connector`` returns classes that really move KV: full blocks are saved to a
dict keyed by their token prefix once computed, and loaded into the pool on a later match. It
proves that KV a connector writes into the pool is what later forwards read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdepot.integrations.tensorrt_llm.api import KvCacheConnectorScheduler, KvCacheConnectorWorker


@dataclass
class Script:
    """What the recording connector answers, and everything it was asked."""

    matched: tuple[int, bool] | Callable[[Any, int], tuple[int, bool]] = (0, False)
    finished_returns: bool = False
    save_delay_polls: int = 0  # get_finished calls after the one passing an id before reporting it
    load_delay_polls: int = 0
    calls: list[tuple[str, tuple]] = field(default_factory=list)
    streams: list[Any] = field(default_factory=list)  # as given: CUDA streams do not deepcopy
    layer_streams: list[Any] = field(default_factory=list)  # the layer hooks' streams
    requests: list[tuple[str, Any]] = field(default_factory=list)  # (call, request object as given)
    on_init: Callable[[str], None] | None = None

    def log(self, name: str, *args: Any) -> None:
        self.calls.append((name, copy.deepcopy(args)))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def args(self, name: str) -> list[tuple]:
        return [a for n, a in self.calls if n == name]

    def count(self, name: str) -> int:
        return len(self.args(name))


def make_recording_connector(script: Script) -> tuple[type, type]:
    class RecordingScheduler(KvCacheConnectorScheduler):
        def __init__(self, llm_args: Any):
            super().__init__(llm_args)
            if script.on_init:
                script.on_init("scheduler")

        def build_connector_meta(self, scheduler_output: Any) -> object:
            script.log("build_connector_meta", scheduler_output)
            return {"step": script.count("build_connector_meta")}

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            script.log("get_num_new_matched_tokens", request.request_id, num_computed_tokens)
            script.requests.append(("get_num_new_matched_tokens", request))
            assert not hasattr(request, "py_request_id")  # the C++ binding view
            m = script.matched
            return m(request, num_computed_tokens) if callable(m) else m

        def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
            script.log("request_finished", request.py_request_id, cache_block_ids)
            script.requests.append(("request_finished", request))
            return script.finished_returns

        def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
            script.log("update_state_after_alloc", request.py_request_id, block_ids)
            script.requests.append(("update_state_after_alloc", request))

    class RecordingWorker(KvCacheConnectorWorker):
        def __init__(self, llm_args: Any):
            super().__init__(llm_args)
            self._held: dict[int, list] = {}  # id -> [kind, polls left]
            if script.on_init:
                script.on_init("worker")

        def register_forward_pass_callable(self) -> Callable[[], None]:
            script.log("register_forward_pass_callable")
            return lambda: script.log("forward_pass_callable")

        def bind_connector_meta(self, metadata: object) -> None:
            script.log("bind_connector_meta", metadata)
            super().bind_connector_meta(metadata)

        def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
            script.log("register_kv_caches", tuple(kv_cache_tensor.shape), kv_cache_tensor.dtype)

        def start_load_kv(self, stream: Any) -> None:
            script.log("start_load_kv", stream is None)
            script.streams.append(stream)

        def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
            script.log("wait_for_layer_load", layer_idx)
            script.layer_streams.append(stream)

        def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
            script.log("save_kv_layer", layer_idx)
            script.layer_streams.append(stream)

        def wait_for_save(self, stream: Any) -> None:
            script.log("wait_for_save", stream is None)
            script.streams.append(stream)

        def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]):
            script.log("get_finished", finished_gen_req_ids, started_loading_req_ids)
            for rid in finished_gen_req_ids:
                self._held[rid] = ["save", script.save_delay_polls]
            for rid in started_loading_req_ids:
                self._held[rid] = ["load", script.load_delay_polls]
            done: dict[str, list[int]] = {"save": [], "load": []}
            for rid, entry in list(self._held.items()):
                if entry[1] == 0:
                    done[entry[0]].append(rid)
                    del self._held[rid]
                else:
                    entry[1] -= 1
            return done["save"], done["load"]

    return RecordingScheduler, RecordingWorker


@dataclass
class BlockStore:
    """Shared host storage of the block-store connector: prefix tuple -> ``pool[block]`` copy."""

    blocks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    load_async: bool = False
    corrupt_loads: bool = False
    loads: int = 0


def make_block_store_connector(store: BlockStore) -> tuple[type, type]:
    class StoreScheduler(KvCacheConnectorScheduler):
        def __init__(self, llm_args: Any):
            super().__init__(llm_args)
            self.b = llm_args.kv_cache_config.tokens_per_block
            self.reqs: dict[int, dict] = {}  # id -> tokens, blocks, saved (blocks)
            self.pending_loads: list[tuple[tuple[int, ...], int]] = []
            self.matches: dict[int, tuple[int, int, bool]] = {}  # id -> (first, count, async)

        def _key(self, tokens: list[int], i: int) -> tuple[int, ...]:
            return tuple(tokens[: (i + 1) * self.b])

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
            if num_computed_tokens % self.b:
                return 0, False
            tokens, first = request.get_tokens(0), num_computed_tokens // self.b
            n = 0
            while (first + n + 1) * self.b < len(tokens) and self._key(tokens, first + n) in store.blocks:
                n += 1
            is_async = store.load_async and n > 0
            self.matches[request.request_id] = (first, n, is_async)
            return n * self.b, is_async

        def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
            first, n, is_async = self.matches.pop(request.py_request_id)
            tokens = request.get_tokens(0)
            loads = [(self._key(tokens, i), block_ids[i]) for i in range(first, first + n)]
            self.pending_loads.extend(loads)
            if is_async:
                self.pending_loads.append(("async-done", request.py_request_id))

        def build_connector_meta(self, scheduler_output: Any) -> object:
            saves = []
            for data in scheduler_output.new_requests + scheduler_output.cached_requests:
                st = self.reqs.setdefault(data.request_id, {"tokens": [], "blocks": [], "saved": 0})
                st["tokens"] += data.new_tokens
                st["blocks"] += data.new_block_ids
                done = (data.computed_position + data.num_scheduled_tokens) // self.b
                done = min(done, len(st["tokens"]) // self.b)
                for i in range(st["saved"], done):
                    saves.append((self._key(st["tokens"], i), st["blocks"][i]))
                st["saved"] = max(st["saved"], done)
            meta = {"loads": self.pending_loads, "saves": saves}
            self.pending_loads = []
            return meta

        def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
            self.reqs.pop(request.py_request_id, None)
            return False

    class StoreWorker(KvCacheConnectorWorker):
        def __init__(self, llm_args: Any):
            super().__init__(llm_args)
            self.loaded: set[int] = set()
            self.started: set[int] = set()

        def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
            self.pool = kv_cache_tensor

        def start_load_kv(self, stream: Any) -> None:
            for key, block in self._metadata["loads"]:
                if key == "async-done":
                    self.loaded.add(block)
                    continue
                data = store.blocks[key]
                self.pool[block].copy_(torch.randn_like(data) if store.corrupt_loads else data)
                store.loads += 1

        def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
            pass

        def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
            pass

        def wait_for_save(self, stream: Any) -> None:
            for key, block in self._metadata["saves"]:
                store.blocks.setdefault(key, self.pool[block].clone())

        def get_finished(self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]):
            self.started.update(started_loading_req_ids)
            ready = self.loaded & self.started
            self.loaded -= ready
            self.started -= ready
            return [], sorted(ready)

    return StoreScheduler, StoreWorker


def recording_engine(script: Script, max_tokens: int = 4096, **args: Any) -> Any:
    """The tiny preset under the reference runtime, its connector recording into ``script``."""
    from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs

    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(max_tokens=max_tokens), **args)
    return Engine("tiny", llm_args=llm_args, connector=make_recording_connector(script))


def prompt(n: int, offset: int = 1) -> list[int]:
    """``n`` deterministic token ids; distinct ``offset``s give distinct prompts."""
    return [(offset + 7 * i) % 500 + 1 for i in range(n)]


def built_outputs(script: Script) -> list[Any]:
    """The SchedulerOutput of every recorded build_connector_meta call, in order."""
    return [a[0] for a in script.args("build_connector_meta")]
