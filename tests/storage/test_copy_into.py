"""``storage.base.CopyInto``: ``get_into`` for tiers that cannot read in place (Redis, test tiers),
so the tier manager reads every tier the same way instead of probing for the method."""

from __future__ import annotations

import pytest

from kvdepot.keys import ChunkKey
from kvdepot.storage.base import CopyInto


class DictTier(CopyInto):
    def __init__(self, objects: dict[bytes, bytes]) -> None:
        self.objects = objects

    def get(self, key: ChunkKey) -> bytes | None:
        return self.objects.get(key)


def test_get_into_copies_the_payload_and_answers_its_length() -> None:
    tier = DictTier({b"a" * 16: b"\x01\x02\x03", b"b" * 16: b"\x07" * 8})
    out = bytearray(8)
    assert tier.get_into(ChunkKey(b"a" * 16), out) == 3 and out[:3] == b"\x01\x02\x03"
    assert tier.get_into(ChunkKey(b"b" * 16), memoryview(out)) == 8 and out == b"\x07" * 8
    assert tier.get_into(ChunkKey(b"c" * 16), out) is None  # a miss


def test_get_into_refuses_a_payload_longer_than_the_buffer() -> None:
    tier = DictTier({b"a" * 16: b"\x00" * 9})
    with pytest.raises(ValueError, match="longer than the 8-byte buffer"):
        tier.get_into(ChunkKey(b"a" * 16), bytearray(8))
