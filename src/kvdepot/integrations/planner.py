"""The scheduler half's step planner, shared by every engine connector.

Each step a connector's scheduler half tells its worker half, per request, only what is new
(``deltas.RequestDelta``): keys and block ids not sent yet, a load not sent yet, and how many
chunks will be fully computed after the step. Deciding that needs a record of what was already
sent; both the TensorRT-LLM and the vLLM connector used to keep a copy of that record and of the
decision. They now keep only what is engine-specific: how a scheduler output becomes
``computed`` tokens and new block ids, and how a delta becomes their metadata item.

    SentState                       a request's sent-state; connectors subclass it with their fields
    SentState.resend(block_ids)     the worker half starts the request over: send it all again
    SentState.forget()              the worker half dropped the request (its blocks are gone)
    DeltaPlanner.plan(...)          -> Planned | None: this step's delta, None when nothing is new
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvdepot.integrations.deltas import RequestDelta


@dataclass
class SentState:
    """What the scheduler half knows of one live request and has told the worker half of it."""

    prompt_len: int
    keys: list[bytes]  # keys of the request's full chunks hashed so far (grows during decode)
    block_ids: list[int] = field(default_factory=list)  # the engine's blocks for the request, in order
    load: tuple[int, int] | None = None  # (skip_blocks, num_blocks) not yet sent to the worker half
    sent_keys: int = 0  # keys[:sent_keys] are held by the worker half
    sent_blocks: int = 0  # block_ids[:sent_blocks] are held by the worker half
    saved_upto: int = 0  # chunks the worker half was told to save
    known: bool = False  # the worker half holds state for it
    reset: bool = False  # the next item tells the worker half to drop what it holds first

    def resend(self, block_ids: list[int] | None = None) -> None:
        """The worker half must start this request over (optionally on a new block list): the next
        item carries ``reset`` and every key and block id again."""
        if block_ids is not None:
            self.block_ids = block_ids
        self.sent_keys = self.sent_blocks = 0
        self.reset = True

    def forget(self) -> None:
        """The worker half dropped this request and the engine freed its blocks (vLLM preemption):
        whatever it saved is cached already, and nothing of it may be held for saves any more."""
        self.resend()
        self.known, self.saved_upto = False, 0


@dataclass
class Planned:
    """One request's instructions for this step, for the connector to turn into its own item."""

    delta: RequestDelta
    reset: bool = False  # the worker half drops what it holds of the request before the delta


class DeltaPlanner:
    """Decides, per request and step, what the worker half loads and which chunks it saves."""

    def __init__(self, tokens_per_block: int, saves: bool = True) -> None:
        self._block = tokens_per_block
        self._saves = saves  # False: never save (a load-only connector)

    def plan(
        self,
        rid: int | str,
        state: SentState,
        computed: int,
        num_tokens: int,
        *,
        chunk_size: int,
        save_decode: bool,
        more_keys: Callable[[], list[bytes]],
    ) -> Planned | None:
        """Emit this step's load and the chunks that will be fully computed after this step.

        Args:
            rid: the engine's request id, copied into the delta.
            state: the request's sent-state; updated as if the returned delta was sent.
            computed: tokens whose KV is in the request's blocks once this step has run.
            num_tokens: the request's tokens so far (prompt and generated).
            chunk_size: tokens per kvdepot chunk.
            save_decode: whether chunks past the prompt are saved too.
            more_keys: the keys of every full chunk of the request's tokens; called only when
                ``state.keys`` falls short, since hashing (and copying the tokens) costs.

        Returns:
            The delta to send, or None when the worker half needs nothing this step.
        """
        limit = computed if save_decode else min(computed, state.prompt_len)
        limit = min(limit, num_tokens, len(state.block_ids) * self._block)
        upto = limit // chunk_size if self._saves else 0
        if upto > len(state.keys):
            state.keys = more_keys()
            upto = min(upto, len(state.keys))
        load = state.load
        if load is None and upto <= state.saved_upto and not state.reset:
            return None
        delta = RequestDelta(
            rid,
            new_keys=state.keys[state.sent_keys :],
            new_block_ids=state.block_ids[state.sent_blocks :],
            load_skip_blocks=load[0] if load else 0,
            load_num_blocks=load[1] if load else 0,
            save_upto_chunks=max(upto, state.saved_upto),
        )
        planned = Planned(delta, state.reset)
        state.sent_keys, state.sent_blocks = len(state.keys), len(state.block_ids)
        state.load, state.saved_upto, state.known, state.reset = None, delta.save_upto_chunks, True, False
        return planned
