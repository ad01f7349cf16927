"""``transfer.base.BlockMover``'s declared capabilities: every registered mover says whether it
splits loads by layer and how many batches the driver refused, and a mover that does not split
still answers ``scatter_layers`` correctly (the whole load at its first step)."""

from __future__ import annotations

import pytest
import torch

from kvdepot.transfer import MOVERS
from kvdepot.transfer.base import ChunkCopy


@pytest.mark.parametrize("name", sorted(MOVERS))
def test_every_mover_declares_its_capabilities(name: str) -> None:
    mover = MOVERS[name]()
    assert mover.copies_by_layer is (name == "batch")
    assert mover.refused == 0


@pytest.mark.parametrize("name", sorted(MOVERS))
def test_scatter_layers_fills_every_layer_of_every_block_once_it_has_yielded_them_all(name: str) -> None:
    layers, per_layer, blocks = 3, 8, 4
    pool = torch.zeros(6, layers * per_layer, dtype=torch.uint8)
    host = torch.randint(0, 256, (blocks * layers * per_layer,), dtype=torch.uint8)
    ids = [5, 0, 3, 2]
    steps = list(MOVERS[name]().scatter_layers([ChunkCopy(ids, host)], [pool], layers))
    assert steps == list(range(layers))
    assert torch.equal(pool[ids], host.view(blocks, -1))
    assert not pool[[1, 4]].any()  # no other block written


@pytest.mark.parametrize("name", sorted(MOVERS))
def test_every_mover_prepares_a_store_in_two_parts_that_together_gather_it_once(name: str) -> None:
    """``prepare_gather``: ``head`` (any amount, maybe nothing) then ``rest`` leave the host
    buffer exactly as ``gather_many`` does. On a CPU pool no head copies anything (the batch
    mover's torch copies are its fallback, which runs in ``rest``; its head on a device:
    test_batch.py)."""
    pool = torch.randint(0, 256, (6, 16), dtype=torch.uint8)
    ids = [4, 1, 3]
    for head_bytes in (0, 16, 1 << 20):
        host = torch.zeros(3 * 16, dtype=torch.uint8)
        move = MOVERS[name]().prepare_gather([pool], [ChunkCopy(ids, host)])
        move.head(head_bytes)
        assert not host.any()
        move.rest()
        assert torch.equal(host.view(3, 16), pool[ids])
