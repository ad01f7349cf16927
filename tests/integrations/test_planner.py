"""The shared step planner, engine-free: scripted steps of one request and the deltas they give."""

from __future__ import annotations

from kvdepot.integrations.planner import DeltaPlanner, Planned, SentState

TPB, CHUNK = 16, 32  # 2 blocks a chunk
TOKENS = list(range(160))  # 5 chunks


def keys_of(tokens: list[int]) -> list[bytes]:
    """Stand-in chunk keys: one per full chunk, named by its index."""
    return [b"k%d" % i for i in range(len(tokens) // CHUNK)]


class Request:
    """A request the planner is driven for, counting how often it had to hash more keys."""

    def __init__(self, tokens: list[int], prompt_len: int, *, blocks: int = 0) -> None:
        self.tokens = tokens
        self.state = SentState(prompt_len, keys_of(tokens[:prompt_len]), block_ids=list(range(blocks)))
        self.hashed = 0

    def more_keys(self) -> list[bytes]:
        self.hashed += 1
        return keys_of(self.tokens)

    def step(self, planner: DeltaPlanner, computed: int, *, save_decode: bool = False) -> Planned | None:
        return planner.plan("r", self.state, computed, len(self.tokens), chunk_size=CHUNK,
                            save_decode=save_decode, more_keys=self.more_keys)


def verify(planned: Planned | None, *, keys: int, blocks: list[int], save_upto: int,
           load: tuple[int, int] = (0, 0), reset: bool = False) -> None:
    assert planned is not None
    delta = planned.delta
    assert delta.request_id == "r"
    assert len(delta.new_keys) == keys and delta.new_block_ids == blocks
    assert (delta.load_skip_blocks, delta.load_num_blocks) == load
    assert delta.save_upto_chunks == save_upto and planned.reset == reset


def test_chunked_prefill_sends_deltas_and_each_chunk_once_computed() -> None:
    planner, req = DeltaPlanner(TPB), Request(TOKENS, 160, blocks=4)
    verify(req.step(planner, 64), keys=5, blocks=[0, 1, 2, 3], save_upto=2)
    assert req.step(planner, 64) is None  # nothing new: no item at all
    req.state.block_ids += [4, 5]
    verify(req.step(planner, 96), keys=0, blocks=[4, 5], save_upto=3)
    assert req.state.known and req.state.saved_upto == 3


def test_saves_stop_at_the_blocks_held_and_the_tokens_known() -> None:
    planner, req = DeltaPlanner(TPB), Request(TOKENS, 160, blocks=3)
    verify(req.step(planner, 160), keys=5, blocks=[0, 1, 2], save_upto=1)  # 3 blocks: 1 full chunk
    req.state.block_ids += list(range(3, 10))
    verify(req.step(planner, 999), keys=0, blocks=list(range(3, 10)), save_upto=5)


def test_a_load_is_sent_once_and_alone_when_nothing_is_computed_yet() -> None:
    planner, req = DeltaPlanner(TPB), Request(TOKENS, 160, blocks=6)
    req.state.load = (0, 4)
    verify(req.step(planner, 0), keys=5, blocks=list(range(6)), save_upto=0, load=(0, 4))
    assert req.state.load is None and req.step(planner, 0) is None


def test_decode_chunks_are_saved_only_with_save_decode_and_hashed_only_when_needed() -> None:
    prompt = TOKENS[:64]
    req = Request(prompt, 64, blocks=10)
    verify(req.step(DeltaPlanner(TPB), 64), keys=2, blocks=list(range(10)), save_upto=2)
    req.tokens = TOKENS  # decode grew the request to 5 chunks
    assert req.step(DeltaPlanner(TPB), 160) is None and req.hashed == 0  # prompt chunks only
    verify(req.step(DeltaPlanner(TPB), 160, save_decode=True), keys=3, blocks=[], save_upto=5)
    assert req.hashed == 1


def test_a_load_only_planner_never_saves() -> None:
    planner, req = DeltaPlanner(TPB, saves=False), Request(TOKENS, 160, blocks=10)
    assert req.step(planner, 160) is None
    req.state.load = (2, 2)
    verify(req.step(planner, 160), keys=5, blocks=list(range(10)), save_upto=0, load=(2, 2))


def test_resend_starts_the_worker_over_on_a_new_block_list() -> None:
    planner, req = DeltaPlanner(TPB), Request(TOKENS, 160, blocks=4)
    verify(req.step(planner, 64), keys=5, blocks=[0, 1, 2, 3], save_upto=2)
    req.state.resend([7, 8, 9, 10])
    verify(req.step(planner, 64), keys=5, blocks=[7, 8, 9, 10], save_upto=2, reset=True)  # nothing new but reset
    assert req.step(planner, 64) is None


def test_forget_drops_the_saves_the_worker_no_longer_holds() -> None:
    planner, req = DeltaPlanner(TPB), Request(TOKENS, 160, blocks=4)
    req.step(planner, 64)
    req.state.forget()
    assert not req.state.known and req.state.saved_upto == 0 and req.state.block_ids == [0, 1, 2, 3]
    req.state.resend([5, 6])
    verify(req.step(planner, 32), keys=5, blocks=[5, 6], save_upto=1, reset=True)
    assert req.state.known
