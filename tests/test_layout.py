"""``kvdepot.layout``: the pool geometry read from a TensorRT-LLM pool tensor, and chunk arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.errors import LayoutError
from kvdepot.layout import PoolLayout

DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int8]


@st.composite
def geometries(draw):
    tpb = draw(st.sampled_from([1, 2, 4, 8, 16]))
    return dict(
        num_blocks=draw(st.integers(1, 9)),
        num_layers=draw(st.integers(1, 4)),
        kv_factor=draw(st.sampled_from([1, 2])),
        block_elems=tpb * draw(st.integers(1, 6)),
        tokens_per_block=tpb,
        chunk_size=tpb * draw(st.integers(1, 5)),
        dtype=draw(st.sampled_from(DTYPES)),
    )


@settings(max_examples=60, deadline=None)
@given(g=geometries())
def test_from_pool_reads_the_geometry_and_sizes_match_the_tensor(g):
    pool = torch.empty(g["num_blocks"], g["num_layers"], g["kv_factor"], g["block_elems"], dtype=g["dtype"])
    layout = PoolLayout.from_pool(pool, g["tokens_per_block"], g["chunk_size"])
    assert (layout.num_blocks, layout.num_layers, layout.kv_factor, layout.block_elems) == tuple(pool.shape)
    assert layout.dtype == g["dtype"]
    assert layout.element_size == pool.element_size()
    assert layout.bytes_per_block == pool[0].numel() * pool.element_size()
    assert layout.bytes_per_block * layout.num_blocks == pool.numel() * pool.element_size()
    assert layout.blocks_per_chunk == g["chunk_size"] // g["tokens_per_block"]
    assert layout.chunk_bytes == layout.blocks_per_chunk * layout.bytes_per_block
    assert layout.dtype_name == str(g["dtype"]).removeprefix("torch.")
    layout.check_pool(pool)
    # The geometry leaves out num_blocks: pools of other sizes share chunks.
    bigger = PoolLayout.from_pool(torch.empty(g["num_blocks"] + 3, *pool.shape[1:], dtype=g["dtype"]), g["tokens_per_block"], g["chunk_size"])
    assert bigger.geometry == layout.geometry


@settings(max_examples=60, deadline=None)
@given(g=geometries(), num_tokens=st.integers(0, 100), num_ids=st.integers(0, 30))
def test_chunk_arithmetic(g, num_tokens, num_ids):
    layout = PoolLayout(**g)
    chunks = layout.full_chunks(num_tokens, num_ids)
    assert chunks * layout.chunk_size <= num_tokens and chunks * layout.blocks_per_chunk <= num_ids
    assert (chunks + 1) * layout.chunk_size > num_tokens or (chunks + 1) * layout.blocks_per_chunk > num_ids
    covered = [p for c in range(chunks) for p in layout.chunk_blocks(c)]
    assert covered == list(range(chunks * layout.blocks_per_chunk))  # chunks tile the block list in order
    for c in range(chunks):
        blocks = layout.chunk_blocks(c)
        # Chunk c's blocks hold exactly tokens [c*C, (c+1)*C).
        assert blocks[0] * layout.tokens_per_block == c * layout.chunk_size
        assert (blocks[-1] + 1) * layout.tokens_per_block == (c + 1) * layout.chunk_size


BAD_POOLS = [
    ("3-D", lambda: torch.empty(4, 2, 64, dtype=torch.float16), "4-D"),
    ("5-D", lambda: torch.empty(4, 2, 2, 8, 8, dtype=torch.float16), "4-D"),
    ("non-contiguous", lambda: torch.empty(4, 2, 2, 64, dtype=torch.float16).transpose(0, 1), "contiguous"),
    ("strided-slice", lambda: torch.empty(8, 2, 2, 64, dtype=torch.float16)[::2], "contiguous"),
    ("bool", lambda: torch.empty(4, 2, 2, 64, dtype=torch.bool), "dtype"),
    ("complex", lambda: torch.empty(4, 2, 2, 64, dtype=torch.complex64), "dtype"),
    ("kv_factor-3", lambda: torch.empty(4, 2, 3, 64, dtype=torch.float16), "kv_factor"),
    ("zero-blocks", lambda: torch.empty(0, 2, 2, 64, dtype=torch.float16), "num_blocks"),
    ("row-not-multiple-of-tpb", lambda: torch.empty(4, 2, 2, 60, dtype=torch.float16), "tokens_per_block"),
    ("not-a-tensor", lambda: [[0.0]], "torch.Tensor"),
]


@pytest.mark.parametrize(("make", "fragment"), [c[1:] for c in BAD_POOLS], ids=[c[0] for c in BAD_POOLS])
def test_bad_pools_are_refused_clearly(make, fragment):
    with pytest.raises(LayoutError, match=fragment):
        PoolLayout.from_pool(make(), tokens_per_block=16, chunk_size=32)


def test_chunk_size_must_be_a_multiple_of_tokens_per_block():
    pool = torch.empty(4, 2, 2, 64, dtype=torch.float16)
    with pytest.raises(LayoutError, match=r"chunk_size=24 .* tokens_per_block=16"):
        PoolLayout.from_pool(pool, tokens_per_block=16, chunk_size=24)
    for name, value in (("tokens_per_block", 0), ("chunk_size", -16)):
        kwargs = dict(tokens_per_block=16, chunk_size=32) | {name: value}
        with pytest.raises(LayoutError, match=name):
            PoolLayout.from_pool(pool, **kwargs)


def test_check_pool_refuses_another_shape_or_dtype():
    layout = PoolLayout.from_pool(torch.empty(4, 2, 2, 64, dtype=torch.float16), 16, 32)
    for other in (torch.empty(5, 2, 2, 64, dtype=torch.float16), torch.empty(4, 2, 2, 64, dtype=torch.bfloat16)):
        with pytest.raises(LayoutError, match="does not match"):
            layout.check_pool(other)


def test_check_block_ids():
    layout = PoolLayout.from_pool(torch.empty(4, 1, 1, 16, dtype=torch.float16), 16, 16)
    layout.check_block_ids([3, 0, 2, 1])
    layout.check_block_ids([])
    for bad in ([4], [0, -1], [1.0], ["1"], [None], [2**63], [np.float64(1.0)]):
        with pytest.raises(LayoutError, match=r"out of range \[0, 4\)"):
            layout.check_block_ids(bad)
    layout.check_block_ids([np.int64(3), True, 0])  # anything with __index__ is an integer, as before


def test_check_block_ids_distinct():
    layout = PoolLayout.from_pool(torch.empty(4, 1, 1, 16, dtype=torch.float16), 16, 16)
    layout.check_block_ids([1, 2, 1])  # repeats are only refused when asked
    layout.check_block_ids([3, 0, 2, 1], distinct=True)
    layout.check_block_ids([], distinct=True)
    with pytest.raises(LayoutError, match="distinct"):
        layout.check_block_ids([1, 2, 1], distinct=True)
    with pytest.raises(LayoutError, match="out of range"):  # the range is checked first
        layout.check_block_ids([4, 4], distinct=True)
