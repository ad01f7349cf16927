"""vLLM's KV-event wire format, declared here so kvdepot never imports vLLM.

One message on the PUB socket is three frames::

    topic (UTF-8, may be empty) | sequence number (8 bytes, big-endian, from 0, no gaps) | payload

and the payload is a msgpack ``KVEventBatch``: an *array* ``[ts, events, data_parallel_rank]``
whose events are *maps* tagged by class name under ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), with fields that have defaults left out when they hold them. Field names,
their order, the tags and those encoding options are the compatibility contract (vLLM 0.32's
``vllm.distributed.kv_events``, which the tests decode our bytes with); the structs below are ours.

Block hashes are unsigned 64-bit integers here (``hashes.py``); vLLM also allows bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = bytes | int


class KVEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events: a map with a ``"type"`` tag."""


class BlockStored(KVEvent):
    block_hashes: list[BlockHash]  # one per engine block, in token order
    parent_block_hash: BlockHash | None  # the hash of the block before the first, None at the start
    token_ids: list[int]  # the tokens of every block, concatenated
    block_size: int  # tokens per engine block
    lora_id: int | None
    medium: str | None  # "CPU" or "STORAGE"
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # "LOCAL" or "REMOTE" relative to the publisher
    ownership: str | None = None  # the secondary tier's name: "disk" or "redis"
    session_id: str | None = None


class BlockRemoved(KVEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # wall-clock seconds when the batch was sent
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay stream's last message carries this

_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload frame as a batch; ``msgspec.DecodeError`` if it is not one."""
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
