"""Request objects shaped like TensorRT-LLM's, and the result the engine returns.

TensorRT-LLM gives ``get_num_new_matched_tokens`` the C++ ``LlmRequest`` (only what the bindings
expose, a different Python object each call) and ``update_state_after_alloc``/``request_finished``
the Python ``_torch`` subclass (with ``py_*`` attributes). We mirror that split: ``LlmRequest`` is
the Python-side request, and ``CppRequestView`` a fresh, binding-only view of it, so a connector
that keys state by object identity or reads ``py_*`` in the wrong call fails here as it would there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch


class LlmRequestState(Enum):
    """The states of ``tensorrt_llm.bindings.LlmRequestState`` that this engine uses."""

    CONTEXT_INIT = 2
    GENERATION_IN_PROGRESS = 4
    GENERATION_COMPLETE = 6
    DISAGG_GENERATION_TRANS_IN_PROGRESS = 8  # parked while a connector loads asynchronously
    DISAGG_CONTEXT_TRANS_IN_PROGRESS = 10  # finished, blocks held while a connector saves


@dataclass
class LlmRequest:
    """The Python-side request (``tensorrt_llm._torch.pyexecutor.llm_request.LlmRequest``)."""

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    state: LlmRequestState = LlmRequestState.CONTEXT_INIT
    context_current_position: int = 0
    context_chunk_size: int = 0
    prepopulated_prompt_len: int = 0
    num_connector_matched_tokens: int = 0
    cache_salt: str | None = None
    end_id: int | None = None
    # Overlap scheduler: tokens the host has seen (None: all). The last sampled token reaches the
    # host one iteration late, so get_tokens lags it, as 1.2's SchedulerOutput deltas show.
    num_visible_tokens: int | None = None
    # engine bookkeeping, not part of TensorRT-LLM's surface
    num_device_reused_tokens: int = 0
    connector_async_load: bool = False
    submit_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    logits: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def py_request_id(self) -> int:
        return self.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def orig_prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def py_max_new_tokens(self) -> int:
        return self.max_new_tokens

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    def get_tokens(self, beam: int | None = None) -> list[int] | list[list[int]]:
        """Prompt plus generated tokens: ``get_tokens(0)`` for beam 0, ``get_tokens()`` for all."""
        seen = self.tokens[: self.num_visible_tokens]
        return seen if beam is not None else [seen]

    def get_num_tokens(self, beam: int = 0) -> int:
        return len(self.tokens[: self.num_visible_tokens])

    @property
    def context_remaining_length(self) -> int:
        return self.prompt_len - self.context_current_position

    @property
    def is_first_context_chunk(self) -> bool:
        return self.context_current_position == self.prepopulated_prompt_len

    @property
    def is_last_context_chunk(self) -> bool:
        return self.context_current_position + self.context_chunk_size >= self.prompt_len

    @property
    def is_context_init_state(self) -> bool:
        return self.state == LlmRequestState.CONTEXT_INIT

    @property
    def is_generation_in_progress_state(self) -> bool:
        return self.state == LlmRequestState.GENERATION_IN_PROGRESS

    @property
    def is_finished(self) -> bool:
        return self.state in (LlmRequestState.GENERATION_COMPLETE,
                              LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS)

    is_dummy_request = False
    is_generation_only_request = False
    is_context_only_request = False
    cache_salt_id = None
    lora_task_id = None
    num_draft_tokens = 0

    @property
    def draft_tokens(self) -> list[int]:
        return []  # no speculative decoding: connectors are rejected with it (reference §3.1)

    @property
    def py_draft_tokens(self) -> list[int]:
        return []

    kv_cache_retention_config = None
    multimodal_hashes = None


_BOUND = frozenset({
    "request_id", "get_tokens", "get_num_tokens", "prompt_len", "orig_prompt_len", "max_new_tokens",
    "state", "context_current_position", "context_remaining_length", "context_chunk_size",
    "is_first_context_chunk", "is_last_context_chunk", "prepopulated_prompt_len",
    "is_generation_only_request", "is_context_only_request", "is_dummy_request", "cache_salt_id",
    "lora_task_id", "draft_tokens", "num_draft_tokens", "multimodal_hashes",
    "num_connector_matched_tokens", "is_context_init_state", "is_generation_in_progress_state",
    "is_finished",
})


class CppRequestView:
    """What the C++ ``LlmRequest`` binding exposes; ``py_*`` attributes are deliberately absent."""

    __slots__ = ("_req",)

    def __init__(self, req: LlmRequest):
        object.__setattr__(self, "_req", req)

    def __getattr__(self, name: str) -> object:
        if name not in _BOUND:
            raise AttributeError(f"the C++ LlmRequest binding has no attribute {name!r}")
        return getattr(self._req, name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{name!r} is read-only on the request given to get_num_new_matched_tokens")


@dataclass
class Result:
    """One finished request, as ``Engine.generate`` returns it."""

    request_id: int
    prompt_len: int
    output_ids: list[int]
    logits: list[torch.Tensor]  # float32 [vocab] per generated token (only the first if asked)
    ttft_s: float  # submission to first sampled token, device synchronized
    latency_s: float  # submission to last token
    num_device_reused_tokens: int  # prompt tokens found in the pool (block-aligned)
    num_connector_matched_tokens: int  # prompt tokens the connector said it would load
    connector_async_load: bool
    error: str | None = None  # an error response: the step's forward raised (reference §7.3)

    @property
    def num_cached_tokens(self) -> int:
        return self.num_device_reused_tokens + self.num_connector_matched_tokens
