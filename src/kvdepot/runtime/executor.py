"""A small paged inference engine that treats a KV connector the way TensorRT-LLM 1.2's PyTorch executor does.

One ``step()`` is one ``_executor_loop`` iteration (eager, reference §5.1):

1. schedule: running decodes (1 token each), running prefills (next chunk), then waiting requests
   in FCFS order while blocks allow (GUARANTEED_NO_EVICT: the whole prompt + max_new_tokens must
   fit). A new request allocates its prompt's blocks only, matches the device prefix, asks the
   connector (``get_num_new_matched_tokens`` with a C++-style view → ``update_state_after_alloc``
   with the Python request); an async match parks it. Decode blocks are allocated one at a time
   and reach the connector only as ``cached_requests[].new_block_ids`` deltas;
2. ``build_connector_meta(SchedulerOutput)`` → ``bind_connector_meta`` → ``start_load_kv(outer)``;
3. the forward on its own *execution stream* (CUDA), which first waits for the outer stream:
   ``wait_for_layer_load(i, exec)`` / layer i / ``save_kv_layer(i, exec)``, the forward-pass
   callable; then the outer stream waits for the execution stream and ``wait_for_save(outer)``;
4. greedy sampling; with the overlap scheduler (1.2's default) the tokens reach the host, and
   finished requests reach ``request_finished``, one iteration late, after the next forward;
   on True the request is freed and only its blocks stay pinned until the save is reported;
5. ``get_finished(new_saving_ids, new_loading_ids)``: unpins saved blocks, unparks loaded requests.

An exception raised in the forward (a layer hook, the forward-pass callable, ``wait_for_save``) is
caught as 1.2's ``_forward_step`` → ``_handle_errors`` does (reference §7.3; docs/tensorrt-llm.md):
**every** active request, parked ones too, ends with an error response (``Result.error``) and is
freed as ``releaseBlocks`` frees it — its full blocks of ``tokens[:-1]`` stored for device reuse
whatever they hold, ``request_finished`` not called. With the overlap scheduler (1.2's default) the
loop then stops; without it the loop goes on and a later prompt with that prefix reuses those
blocks. An exception from any other connector call propagates (the loop stops, nothing is stored).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvdepot.errors import ConfigError
from kvdepot.runtime.block_manager import BlockManager
from kvdepot.runtime.connector import ConnectorClasses, ConnectorManager, resolve_connector_classes
from kvdepot.runtime.llm_args import KvCacheConnectorConfig, TorchLlmArgs, validate_llm_args
from kvdepot.runtime.model import ModelConfig, Segment
from kvdepot.runtime.request import LlmRequest, LlmRequestState, Result
from kvdepot.runtime.tp import TpGroup, shard_model
from kvdepot.runtime.weights import build_model


class ExecutorStopped(RuntimeError):
    """The executor loop has ended (1.2's overlap loop after an error in the forward)."""


CPU_DEFAULT_MAX_TOKENS = 16384  # pool size on CPU when kv_cache_config.max_tokens is unset
State = LlmRequestState


class Engine:
    """Generate greedily with a Llama model over a TensorRT-LLM-shaped KV pool, driving a connector."""

    def __init__(
        self,
        model: ModelConfig | str | Path | None = None,
        *,
        device: str | torch.device = "cpu",
        llm_args: TorchLlmArgs | None = None,
        connector: ConnectorClasses | None = None,
        seed: int = 0,
        tp: TpGroup | None = None,
        warmup: bool | None = None,
    ):
        """``tp``: this process is one rank of ``tensor_parallel_size`` (``runtime.tp``); every rank
        builds the same full model (same ``seed``) and keeps its own part of it and of the pool.
        ``warmup``: run ``warm_up`` before the connector sees the pool, as 1.2's ``PyExecutor``
        does (reference §5.1); None: on CUDA only, the device whose first forwards of a kind cost
        a one-time toll (on CPU ``bench firsthit`` found none, and the test suite builds
        hundreds of engines)."""
        args = llm_args or TorchLlmArgs()
        classes = connector or resolve_connector_classes(args)
        validate_llm_args(args, classes is not None, tp.size if tp is not None else 1)
        if classes is not None and args.kv_connector_config is None:
            # Connectors read kv_connector_config (e.g. server_url); name the classes we were given.
            args = replace(args, kv_connector_config=KvCacheConnectorConfig(
                connector_module=classes[0].__module__, connector_scheduler_class=classes[0].__name__,
                connector_worker_class=classes[1].__name__))
        self.device = torch.device(device)
        self.model, name = build_model(model if model is not None else args.model, self.device, seed)
        self.tp = tp
        if tp is not None:
            self.model = shard_model(self.model, tp)
        self.llm_args = args if args.model else replace(args, model=name)  # never mutate the caller's
        kv = self.llm_args.kv_cache_config
        self.tokens_per_block = kv.tokens_per_block
        self.num_blocks = self._num_blocks()
        self.pool = torch.zeros(self.model.pool_shape(self.num_blocks, self.tokens_per_block),
                                dtype=self.model.config.pool_dtype, device=self.device)
        self.blocks = BlockManager(self.num_blocks, self.tokens_per_block, kv.enable_block_reuse)
        # The forward's own stream, as 1.2's PyExecutor has: layer hooks see it, the rest the outer one.
        self.execution_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # 1.2's order (reference §5.1): the connector is built, the executor warms up, then the
        # pool is registered, so no warm-up forward reaches a connector hook.
        self.connector = ConnectorManager.create(classes, self.llm_args, tp) if classes else None
        if self.device.type == "cuda" if warmup is None else warmup:
            self.warm_up()
        if self.connector is not None:
            self.connector.register_kv_caches(self.pool)
        self.async_timeout_s = 120.0
        self.overlap = not self.llm_args.disable_overlap_scheduler
        self._next_id = 1
        self._waiting: deque[LlmRequest] = deque()
        self._active: list[LlmRequest] = []  # admitted: prefill, decode or parked for a load
        self._pinned: set[int] = set()  # finished, freed; their blocks wait for get_finished
        self._unprocessed: list[tuple[LlmRequest, int]] = []  # sampled, not on the host yet (overlap)
        self._reserved: dict[int, int] = {}  # blocks each running request may still need
        self._keep_all_logits: dict[int, bool] = {}
        self.results: dict[int, Result] = {}

    def _num_blocks(self) -> int:
        kv, c = self.llm_args.kv_cache_config, self.model.config
        caps = [kv.max_tokens // kv.tokens_per_block] if kv.max_tokens else []
        if self.device.type == "cuda" and kv.free_gpu_memory_fraction:
            per_block = c.kv_bytes_per_token * kv.tokens_per_block
            caps.append(int(torch.cuda.mem_get_info(self.device)[0] * kv.free_gpu_memory_fraction) // per_block)
        elif not caps:
            caps.append(CPU_DEFAULT_MAX_TOKENS // kv.tokens_per_block)
        if min(caps) <= 0:
            raise ConfigError(f"KV pool would have {min(caps)} blocks; raise max_tokens")
        return min(caps)

    def warm_up(self) -> None:
        """The forwards a serving engine meets, run once on free blocks with no connector hook
        (1.2's ``PyExecutor.__init__`` warms up before it registers the pool: reference §5.1).

        A process's first forward of each kind pays a one-time toll on CUDA (kernels loaded on
        their first launch, library heuristics for a new shape): issue 19 measured 35–60 ms on
        the first forward over past KV, whichever hit, the engine's or kvdepot's, came first.
        So, for request A: a prefill from position 0 (causal attention), a chunk after it (a
        query over past KV with a mask: a prefix hit's recomputed tail, chunked prefill), one
        token over past KV (decode); then a batch of A's next token and a prefill of B. The
        blocks are the pool's first ones, which the block manager never hears of, zeroed after
        (every request writes or loads its blocks before it attends over them anyway)."""
        tpb, vocab = self.tokens_per_block, self.model.config.vocab_size
        prefill, chunk = 2 * tpb, max(2, tpb)  # a hit recomputes about a block after its loaded past
        a_blocks = -(-(prefill + chunk + 2) // tpb)
        if a_blocks + 1 > self.num_blocks:
            return  # a pool this small is a test's
        a, b = list(range(a_blocks)), [a_blocks]
        tokens = [(7 * i + 1) % vocab for i in range(prefill + chunk + 2)]
        steps = [
            [Segment(tokens[:prefill], 0, a)],
            [Segment(tokens[prefill : prefill + chunk], prefill, a)],
            [Segment(tokens[prefill + chunk : prefill + chunk + 1], prefill + chunk, a)],
            [Segment(tokens[-1:], prefill + chunk + 1, a), Segment(tokens[1 : tpb + 1], 0, b)],
        ]
        stream = self.execution_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for segments in steps:
                self.model.forward(segments, self.pool)
            self.pool[: a_blocks + 1].zero_()
        if stream is not None:
            stream.synchronize()

    # -- public API ------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], max_new_tokens: int, keep_all_logits: bool = True,
               end_id: int | None = None) -> int:
        """Queue one request; returns its id. It runs on the next ``step()`` calls."""
        prompt = [int(t) for t in prompt]
        if not prompt or max_new_tokens < 1:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        if any(t < 0 or t >= self.model.config.vocab_size for t in prompt):
            raise ValueError(f"prompt token outside [0, {self.model.config.vocab_size})")
        if self.blocks.blocks_for(len(prompt) + max_new_tokens - 1) > self.num_blocks:
            raise ValueError(f"prompt {len(prompt)} + {max_new_tokens} new tokens exceed the pool")
        if not self.llm_args.enable_chunked_prefill and len(prompt) > self.llm_args.max_num_tokens:
            raise ValueError("prompt longer than max_num_tokens and chunked prefill is off")
        req = LlmRequest(self._next_id, prompt, max_new_tokens, end_id=end_id,
                         submit_time=time.perf_counter())
        self._next_id += 1
        self._keep_all_logits[req.request_id] = keep_all_logits
        self._waiting.append(req)
        return req.request_id

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                 keep_all_logits: bool = True) -> list[Result]:
        """Submit every prompt at once (they batch together) and run until all are done.

        Results are returned (and dropped from ``self.results``) in prompt order.
        """
        counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        ids = [self.submit(p, n, keep_all_logits) for p, n in zip(prompts, counts, strict=True)]
        self.run_until_done()
        return [self.results.pop(i) for i in ids]

    def generate_sequential(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                            keep_all_logits: bool = True) -> list[Result]:
        """One request at a time; each waits for the previous one's async saves to complete."""
        return [self.generate([p], max_new_tokens, keep_all_logits)[0] for p in prompts]

    def has_work(self) -> bool:
        return bool(self._waiting or self._active or self._pinned or self._unprocessed)

    def run_until_done(self) -> None:
        """Step until nothing waits, runs, loads or saves; polls gently while only the connector works."""
        idle_since: float | None = None
        while self.has_work():
            if self.step():
                idle_since = None
                continue
            idle_since = idle_since or time.perf_counter()
            if time.perf_counter() - idle_since > self.async_timeout_s:
                raise TimeoutError(f"connector did not finish saves/loads in {self.async_timeout_s}s")
            time.sleep(0.0005)

    def step(self) -> bool:
        """One executor iteration; returns whether a forward ran."""
        outer = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        batch, parked_now = self._schedule()
        conn = self.connector
        if conn is not None and (batch or parked_now):
            # Context requests first, then generation ones, like TensorRT-LLM's scheduled batch.
            ordered = sorted((r for r, _ in batch), key=lambda r: r.state != State.CONTEXT_INIT)
            out = conn.build_scheduler_output(ordered, self.blocks.block_ids)
            conn.start_batch(out, outer)
        previous, self._unprocessed = self._unprocessed, []
        if batch:
            try:
                self._forward(batch, outer)
            except Exception as exc:  # noqa: BLE001 - 1.2 answers the requests with the error
                failed = self._fail_active(f"{type(exc).__name__}: {exc}")
                previous = [(r, n) for r, n in previous if r.request_id not in failed]
                if self.overlap:  # 1.2's overlap loop: no sample state after a failed forward
                    raise ExecutorStopped("Sampling failed (1.2's overlap loop ends after an error in the "
                                          f"forward: {type(exc).__name__}: {exc})") from exc
        # Overlap: the previous iteration's tokens reach the host now, after this forward was issued.
        self._process(previous if self.overlap else self._unprocessed)
        if not self.overlap:
            self._unprocessed = []
        if conn is not None:
            saved, loaded = conn.get_finished()
            for rid in saved:
                self._pinned.remove(rid)
                self._release(rid)
            for req in self._active:
                if req.request_id in loaded:
                    req.state = State.CONTEXT_INIT
        return bool(batch)

    # -- scheduling ------------------------------------------------------------------------------

    def _chunk(self, req: LlmRequest, budget: int) -> int:
        """Next prefill chunk: the rest of the prompt, or a block-aligned piece that fits ``budget``."""
        pos, remaining = req.context_current_position, req.context_remaining_length
        if remaining <= budget:
            return remaining
        if not self.llm_args.enable_chunked_prefill:
            return 0
        end = (pos + budget) // self.tokens_per_block * self.tokens_per_block
        return max(0, end - pos)

    def _schedule(self) -> tuple[list[tuple[LlmRequest, int]], list[LlmRequest]]:
        args, batch, parked = self.llm_args, [], []
        budget = args.max_num_tokens
        for req in self._active:
            if req.state == State.GENERATION_IN_PROGRESS and len(batch) < args.max_batch_size and budget:
                self._grow(req)
                batch.append((req, 1))
                budget -= 1
        for req in self._active:
            if req.state == State.CONTEXT_INIT and len(batch) < args.max_batch_size:
                n = self._chunk(req, budget)
                if n:
                    req.context_chunk_size = n
                    batch.append((req, n))
                    budget -= n
        while self._waiting and len(batch) < args.max_batch_size and self._admissible(self._waiting[0], budget):
            req = self._waiting.popleft()
            self._admit(req)
            self._active.append(req)
            if req.state == State.DISAGG_GENERATION_TRANS_IN_PROGRESS:
                parked.append(req)
                continue
            req.context_chunk_size = self._chunk(req, budget)
            batch.append((req, req.context_chunk_size))
            budget -= req.context_chunk_size
        return batch, parked

    def _admissible(self, req: LlmRequest, budget: int) -> bool:
        """GUARANTEED_NO_EVICT: admit only if prompt + max_new_tokens fits beside every reservation."""
        if self._chunk(req, budget) == 0:
            return False
        bm = self.blocks
        total = bm.blocks_for(req.prompt_len + req.max_new_tokens - 1)
        _, _, in_use = bm.match(req.prompt)
        return total - in_use <= bm.num_available() - sum(self._reserved.values())

    def _admit(self, req: LlmRequest) -> None:
        """V1 ``addSequence``: whole-prompt allocation, device match, then the connector's say."""
        alloc = self.blocks.allocate(req.request_id, req.prompt)
        req.num_device_reused_tokens = alloc.num_reused_tokens
        total = self.blocks.blocks_for(req.prompt_len + req.max_new_tokens - 1)
        self._reserved[req.request_id] = total - len(alloc.block_ids)
        matched, is_async = 0, False
        if self.connector is not None:
            matched, is_async = self.connector.get_num_new_matched_tokens(req, alloc.num_reused_tokens)
        req.num_connector_matched_tokens = matched
        req.prepopulated_prompt_len = req.context_current_position = alloc.num_reused_tokens + matched
        req.connector_async_load = is_async
        if self.connector is not None:
            self.connector.update_state_after_alloc(req, alloc.block_ids)
        if is_async:
            req.state = State.DISAGG_GENERATION_TRANS_IN_PROGRESS

    def _grow(self, req: LlmRequest) -> None:
        """Decode ``add_token``: room for the token computed this step (position len(tokens)-1)."""
        added = self.blocks.grow(req.request_id, len(req.tokens))
        self._reserved[req.request_id] -= len(added)

    # -- forward and completion ------------------------------------------------------------------

    def _forward(self, batch: list[tuple[LlmRequest, int]], outer: Any) -> None:
        segments = []
        for req, n in batch:
            start = req.context_current_position if req.state == State.CONTEXT_INIT else len(req.tokens) - 1
            segments.append(Segment(req.tokens[start : start + n], start, self.blocks.block_ids(req.request_id)))
        exec_stream = self.execution_stream
        if exec_stream is None:
            logits = self._run_model(segments, None)
        else:
            exec_stream.wait_stream(outer)  # what start_load_kv enqueued on `outer` precedes layer 0
            with torch.cuda.stream(exec_stream):
                logits = self._run_model(segments, exec_stream)
            outer.wait_stream(exec_stream)  # wait_for_save's work on `outer` follows every layer
        if self.connector is not None:
            self.connector.wait_for_save(outer)
        sampling = [i for i, (req, n) in enumerate(batch)
                    if req.state != State.CONTEXT_INIT or n == req.context_remaining_length]
        if not sampling:
            for req, n in batch:
                self._advance(req, n)
            return
        stacked = torch.stack([logits[i] for i in sampling])
        next_ids = stacked.argmax(-1).tolist()
        if self.device.type == "cuda":
            # The forward's streams only, as a sampler waits: a connector's side-stream copies
            # (async saves) must not count toward a token's latency.
            torch.cuda.current_stream(self.device).synchronize()
        now = time.perf_counter()
        host = stacked.cpu()
        sampled = dict(zip(sampling, zip(next_ids, host, strict=True), strict=True))
        for i, (req, n) in enumerate(batch):
            self._advance(req, n)
            if i in sampled:
                self._append_token(req, *sampled[i], now)

    def _run_model(self, segments: list[Segment], exec_stream: Any) -> list[torch.Tensor]:
        """The model's forward with the layer hooks, then the forward-pass callable (on ``exec_stream``)."""
        conn = self.connector
        pre, post = conn.layer_hooks(exec_stream) if conn else (None, None)
        logits = self.model.forward(segments, self.pool, pre, post)
        if conn is not None:
            conn.forward_done()
        return logits

    def _advance(self, req: LlmRequest, n: int) -> None:
        """Record that ``n`` more tokens have K/V in the pool and offer their full blocks for reuse."""
        if req.state == State.CONTEXT_INIT:
            req.context_current_position += n
            computed = req.context_current_position
        else:
            computed = len(req.tokens)
        self.blocks.commit(req.request_id, req.tokens, computed)

    def _append_token(self, req: LlmRequest, token: int, logits: torch.Tensor, now: float) -> None:
        if self.overlap and req.num_visible_tokens is None:
            req.num_visible_tokens = len(req.tokens)  # the host sees this token one iteration later
        req.tokens.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
            req.state = State.GENERATION_IN_PROGRESS
        if self._keep_all_logits[req.request_id] or not req.logits:
            req.logits.append(logits)
        if len(req.generated) >= req.max_new_tokens or token == req.end_id:
            # Never scheduled again; the host learns of it (request_finished) in _process.
            req.state, req.finish_time = State.GENERATION_COMPLETE, now
            self._active.remove(req)
        self._unprocessed.append((req, len(req.tokens)))

    def _process(self, sampled: list[tuple[LlmRequest, int]]) -> None:
        """An iteration's sampled tokens reach the host: visible in ``get_tokens``; finished
        requests answered and handed to ``request_finished``."""
        for req, num_tokens in sampled:
            req.num_visible_tokens = None if num_tokens == len(req.tokens) else num_tokens
            if req.state == State.GENERATION_COMPLETE and num_tokens == len(req.tokens):
                self._finish(req)

    def _finish(self, req: LlmRequest) -> None:
        self.results[req.request_id] = self._result(req)
        block_ids = self.blocks.block_ids(req.request_id)
        if self.connector is not None and self.connector.request_finished(req, block_ids):
            # 1.2: the request is answered and freed; only its blocks stay, pinned, until reported.
            req.state = State.DISAGG_CONTEXT_TRANS_IN_PROGRESS
            self._pinned.add(req.request_id)
        else:
            self._release(req.request_id)

    @staticmethod
    def _result(req: LlmRequest, error: str | None = None) -> Result:
        return Result(
            req.request_id, req.prompt_len, req.generated, req.logits,
            ttft_s=req.first_token_time - req.submit_time,  # type: ignore[operator]
            latency_s=req.finish_time - req.submit_time,  # type: ignore[operator]
            num_device_reused_tokens=req.num_device_reused_tokens,
            num_connector_matched_tokens=req.num_connector_matched_tokens,
            connector_async_load=req.connector_async_load, error=error,
        )

    def _fail_active(self, error: str) -> set[int]:
        """1.2's ``_handle_errors``: every active request, parked or not, ends with an error response
        (the ids returned) and is freed as ``free_resources`` frees it: its full blocks of
        ``tokens[:-1]`` are stored for device reuse, computed or not (C++ ``releaseBlocks``), and the
        connector's ``request_finished`` is not called (``get_cache_indices`` fails for a removed
        sequence and the executor skips the save)."""
        failed = list(self._active)
        ids = {r.request_id for r in failed}
        self._unprocessed = [(r, n) for r, n in self._unprocessed if r.request_id not in ids]
        self._active = []
        now = time.perf_counter()
        for req in failed:
            req.state, req.finish_time = State.GENERATION_COMPLETE, now
            req.first_token_time = req.first_token_time or now
            self.results[req.request_id] = self._result(req, error)
            self.blocks.commit(req.request_id, req.tokens, len(req.tokens) - 1)
            self._release(req.request_id)
        return ids

    def _release(self, request_id: int) -> None:
        self.blocks.free(request_id)
        self._reserved.pop(request_id, None)
        self._keep_all_logits.pop(request_id, None)
        if self.connector is not None:
            self.connector.forget(request_id)
