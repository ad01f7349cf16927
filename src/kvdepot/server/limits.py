"""What one server message may carry: the limits on keys, tokens and blocks, and the worst-case
body sizes a frame is checked against before anything is decoded (``protocol.OPS`` uses them).

Decoding holds the GIL, so a legal maximum decoded on the pool still pauses the loop thread: 16M
tokens did for ~0.5 s (seconds on a loaded 2-core host). The limits are a few times the longest
prompts served (1M tokens), no more.
"""

from __future__ import annotations

MAX_KEYS = 1 << 16  # chunk keys in one message (a 16M-token prompt at chunk 256, 1M at chunk 16)
MAX_TOKENS = 1 << 20  # tokens in one LOOKUP by tokens (our clients send keys)
MAX_BLOCKS = 1 << 20  # block ids in one STORE/RETRIEVE
INLINE_KEYS = 2048  # a LOOKUP with more keys runs on the pool: the loop thread serves everyone
# Worst-case msgpack sizes: an int field 9 bytes, a bin or array header 5; a token (uint32) or a
# block id (< 2**31) at most 5 bytes. A body frame longer than its op's bound cannot be legal, so
# it is refused before anything is decoded.
INT, HDR, ID = 9, 5, 5
KEYS = HDR + MAX_KEYS * 16
SMALL = 64  # a body of a few ints
