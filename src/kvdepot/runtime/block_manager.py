"""A KV block pool with prefix reuse, modelled on TensorRT-LLM's V1 KV cache manager.

What a connector observes depends on it, so it copies V1's behaviour:

* a fixed number of blocks (``max_tokens // tokens_per_block``); block id == row of the pool;
* the whole prompt is allocated on a request's first context chunk; decode adds one block when the
  token being computed crosses a block boundary;
* full blocks are identified by a chained digest over their tokens (parent included), registered
  for reuse once their K/V is computed, and matched on later prompts. Matching looks at
  ``prompt[:-1]`` only, so at least one prompt token is always left to compute;
* freed blocks keep their identity and wait in an LRU of evictable blocks; never-identified free
  blocks are handed out first, then the least recently released cached block is evicted.

Primitives: ``match``, ``allocate``, ``grow``, ``commit``, ``free``, ``block_ids``,
``num_available``, ``ref_count``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.errors import KVDepotError

_ROOT = b"kvdepot-runtime-root"


class OutOfBlocks(KVDepotError):
    """Not enough free or evictable blocks; the caller does not schedule the request."""


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Identity of a full block: its tokens and, through ``parent``, every token before them."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class LruPolicy:
    """Order of cached-but-unreferenced blocks: the oldest release is evicted first."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int) -> None:
        self._order[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._order[block_id]

    def pop_victim(self) -> int:
        return self._order.popitem(last=False)[0]

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order

    def __len__(self) -> int:
        return len(self._order)


@dataclass(frozen=True)
class Allocation:
    """A request's prompt allocation: ``num_reused_tokens`` were found on device (block-aligned)."""

    num_reused_tokens: int
    block_ids: list[int]


@dataclass
class _Seq:
    block_ids: list[int]
    digests: list[bytes]  # chained digests of the full blocks already identified


class BlockManager:
    """Blocks, ref counts, reuse index and eviction for one pool (one window, one beam)."""

    def __init__(self, num_blocks: int, tokens_per_block: int, enable_reuse: bool = True):
        if num_blocks <= 0 or tokens_per_block <= 0:
            raise ValueError(f"need positive sizes, got {num_blocks} blocks of {tokens_per_block}")
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.enable_reuse = enable_reuse
        self._ref = [0] * num_blocks
        self._digest: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, no identity
        self._evictable = LruPolicy()  # unreferenced, identity kept for reuse
        self._seqs: dict[int, _Seq] = {}

    def num_available(self) -> int:
        """Blocks an allocation may take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_ids(self, request_id: int) -> list[int]:
        """All blocks of the request, in token order (block i holds tokens [i*B, (i+1)*B))."""
        return list(self._seqs[request_id].block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def match(self, prompt: Sequence[int]) -> tuple[list[int], list[bytes], int]:
        """Cached blocks for the longest full-block prefix of ``prompt[:-1]``.

        Returns:
            (block ids, their digests, how many of them are referenced by running requests).
        """
        if not self.enable_reuse:
            return [], [], 0
        b, parent = self.tokens_per_block, _ROOT
        ids: list[int] = []
        digests: list[bytes] = []
        for i in range((len(prompt) - 1) // b):
            parent = block_digest(parent, prompt[i * b : (i + 1) * b])
            block = self._cached.get(parent)
            if block is None:
                break
            ids.append(block)
            digests.append(parent)
        return ids, digests, sum(1 for x in ids if self._ref[x] > 0)

    def allocate(self, request_id: int, prompt: Sequence[int]) -> Allocation:
        """Reuse the cached prefix and allocate fresh blocks for the rest of the prompt.

        Raises:
            OutOfBlocks: nothing is changed when the prompt does not fit.
        """
        if request_id in self._seqs:
            raise ValueError(f"request {request_id} already holds blocks")
        reused, digests, in_use = self.match(prompt)
        fresh = self.blocks_for(len(prompt)) - len(reused)
        if fresh > self.num_available() - (len(reused) - in_use):
            raise OutOfBlocks(f"prompt of {len(prompt)} tokens needs {fresh} new blocks")
        for block in reused:
            self._acquire(block)
        ids = reused + [self._take() for _ in range(fresh)]
        self._seqs[request_id] = _Seq(ids, digests)
        return Allocation(len(reused) * self.tokens_per_block, list(ids))

    def grow(self, request_id: int, num_tokens: int) -> list[int]:
        """Make room for ``num_tokens`` tokens; returns the blocks added (decode: [] or [id])."""
        seq = self._seqs[request_id]
        need = self.blocks_for(num_tokens) - len(seq.block_ids)
        if need > self.num_available():
            raise OutOfBlocks(f"request {request_id} needs {need} more blocks")
        added = [self._take() for _ in range(need)]
        seq.block_ids.extend(added)
        return added

    def commit(self, request_id: int, tokens: Sequence[int], num_computed: int) -> None:
        """Register for reuse every full block whose K/V (``tokens[:num_computed]``) is computed."""
        if not self.enable_reuse:
            return
        seq, b = self._seqs[request_id], self.tokens_per_block
        parent = seq.digests[-1] if seq.digests else _ROOT
        for i in range(len(seq.digests), min(num_computed, len(tokens)) // b):
            parent = block_digest(parent, tokens[i * b : (i + 1) * b])
            seq.digests.append(parent)
            block = seq.block_ids[i]
            # NOTE: a twin computed concurrently by another request keeps the index entry; this
            # block then stays anonymous and returns to the plain free list.
            if parent not in self._cached and self._digest[block] is None:
                self._cached[parent] = block
                self._digest[block] = parent

    def free(self, request_id: int) -> None:
        """Drop the request's references; its identified blocks stay reusable until evicted."""
        seq = self._seqs.pop(request_id)
        # Released tail first, so under LRU a prefix outlives the blocks that depend on it.
        for block in reversed(seq.block_ids):
            self._ref[block] -= 1
            assert self._ref[block] >= 0, f"block {block} ref count went negative"
            if self._ref[block] == 0:
                if self._digest[block] is None:
                    self._free.append(block)
                else:
                    self._evictable.add(block)

    def _acquire(self, block: int) -> None:
        if self._ref[block] == 0:
            self._evictable.remove(block)
        self._ref[block] += 1

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block = self._evictable.pop_victim()
            del self._cached[self._digest[block]]  # type: ignore[arg-type]
            self._digest[block] = None
        self._ref[block] = 1
        return block
