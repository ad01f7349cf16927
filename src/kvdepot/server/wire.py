"""Framing of the protocol's messages: encode, decode and validate ZMQ frames.

    request_frames(op, req_id, msg, payloads) / parse_request(frames)   client -> server
    parse_header(frames) / decode_body(header, spec, body)   the same in two steps: sizes first
    reply_frames(req_id, msg, payloads) / error_frames(req_id, code, text) / parse_reply_header
    split_keys(blob) / join_keys(keys)                                   16-byte chunk keys

``parse_request`` turns every malformed input into a ``ProtocolError`` carrying the error code
(and the request id when the header could be read), never another exception. ``parse_header``
bounds the body by its operation's ``max_body`` before anything is decoded: a LOOKUP of 400M
tokens is refused as a length, never turned into 400M Python ints.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvdepot.keys import KEY_BYTES
from kvdepot.server.protocol import (
    OPS,
    Buffer,
    ErrorCode,
    ErrorReply,
    OpSpec,
    Payloads,
    ProtocolError,
    ReplyHeader,
    RequestHeader,
)

_MAX_HEADER = 32  # RequestHeader: a 2-array of two ints
_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(RequestHeader)
_reply_header_decoder = msgspec.msgpack.Decoder(ReplyHeader)
_decoders = {t: msgspec.msgpack.Decoder(t) for s in OPS.values() for t in (s.request, s.reply)}
_decoders[ErrorReply] = msgspec.msgpack.Decoder(ErrorReply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(frame: Buffer, kind: type[msgspec.Struct]) -> msgspec.Struct:
    decoder = _decoders.get(kind) or msgspec.msgpack.Decoder(kind)
    return decoder.decode(frame)


def request_frames(op: int, req_id: int, msg: msgspec.Struct, payloads: Payloads = ()) -> list[Buffer]:
    return [encode(RequestHeader(int(op), req_id)), encode(msg), *payloads]


def parse_header(frames: Sequence[Buffer]) -> tuple[RequestHeader, OpSpec]:
    """A request's header and op spec, its body left undecoded; ``ProtocolError`` for anything
    malformed, and for a body longer than its op's ``max_body`` (refused before any decoding)."""
    if len(frames) < 2:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"expected [header, body, *payloads], got {len(frames)} frame(s)")
    if len(frames[0]) > _MAX_HEADER:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"header of {len(frames[0])} bytes (at most {_MAX_HEADER})")
    try:
        header = _header_decoder.decode(frames[0])
    except msgspec.MsgspecError as exc:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"undecodable header: {exc}") from None
    if not 0 <= header.req_id < 2**63:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"request id {header.req_id} out of range")
    spec = OPS.get(header.op)
    if spec is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown operation id {header.op}", header.req_id)
    size = _nbytes(frames[1])
    if size > spec.max_body:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{spec.op.name}: body of {size} bytes exceeds its limit of "
                            f"{spec.max_body} (see protocol.MAX_KEYS/MAX_TOKENS/MAX_BLOCKS)", header.req_id)
    if spec.counts:
        lengths = _peek_lengths(memoryview(frames[1]).cast("B"), max(i for i, _, _ in spec.counts) + 1)
        for index, most, what in spec.counts:
            n = lengths[index] if index < len(lengths) else None
            if n is not None and n > most:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{spec.op.name}: {n} {what} (at most {most})", header.req_id)
    return header, spec


def _peek_lengths(body: memoryview, fields: int) -> list[int | None]:
    """Lengths of the first ``fields`` elements of a msgpack array, read from their headers
    without decoding: an array's or bin's item count, None for a scalar. Stops early (fewer
    entries) at anything else — a map, a string, truncation — which the decoder then refuses."""
    out: list[int | None] = []
    try:
        n, pos = _header(body, 0, _ARRAYS)
        for _ in range(min(n, fields)):
            tag = body[pos]
            if tag in _ARRAYS or tag in _BINS:
                count, start = _header(body, pos, _ARRAYS if tag in _ARRAYS else _BINS)
                out.append(count)
                if tag in _ARRAYS:
                    return out  # its items are not walked, so the fields after it are not reached
                pos = start + count
            elif tag <= 0x7F or tag >= 0xE0 or tag in (0xC0, 0xC2, 0xC3):
                out.append(None)
                pos += 1
            elif tag in _SCALAR_WIDTH:
                out.append(None)
                pos += 1 + _SCALAR_WIDTH[tag]
            else:
                return out
    except (IndexError, ValueError):
        pass
    return out


_ARRAYS = {0xDC: 2, 0xDD: 4, **{t: 0 for t in range(0x90, 0xA0)}}  # array16, array32, fixarray
_BINS = {0xC4: 1, 0xC5: 2, 0xC6: 4}
_SCALAR_WIDTH = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}


def _header(body: memoryview, pos: int, kinds: dict[int, int]) -> tuple[int, int]:
    """(count, position after the header) of the array or bin header at ``pos``."""
    tag = body[pos]
    if tag not in kinds:
        raise ValueError(tag)
    width = kinds[tag]
    if width == 0:
        return tag & 0x0F, pos + 1
    if pos + 1 + width > len(body):
        raise IndexError(pos)
    return int.from_bytes(body[pos + 1 : pos + 1 + width], "big"), pos + 1 + width


def decode_body(header: RequestHeader, spec: OpSpec, frame: Buffer) -> msgspec.Struct:
    """The request's body (``parse_header`` has bounded its size); ``ProtocolError`` if undecodable."""
    try:
        return _decoders[spec.request].decode(frame)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{spec.op.name}: undecodable body: {exc}", header.req_id) from None


def parse_request(frames: Sequence[Buffer]) -> tuple[RequestHeader, OpSpec, msgspec.Struct, list[Buffer]]:
    """Header, op spec, body and payloads of a request; ``ProtocolError`` for anything malformed."""
    header, spec = parse_header(frames)
    return header, spec, decode_body(header, spec, frames[1]), list(frames[2:])


def _nbytes(frame: Buffer) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)


def reply_frames(req_id: int, msg: msgspec.Struct, payloads: Payloads = ()) -> list[Buffer]:
    return [encode(ReplyHeader(req_id, 0)), encode(msg), *payloads]


def error_frames(req_id: int, code: int, message: str) -> list[Buffer]:
    return [encode(ReplyHeader(req_id, int(code))), encode(ErrorReply(int(code), message))]


def parse_reply_header(frame: Buffer) -> ReplyHeader:
    return _reply_header_decoder.decode(frame)


def split_keys(blob: bytes) -> list[bytes]:
    """16-byte chunk keys out of their concatenation; a ragged length is a bad request."""
    if len(blob) % KEY_BYTES:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"keys field of {len(blob)} bytes is not a multiple of {KEY_BYTES}")
    return [blob[i : i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]


def join_keys(keys: Sequence[bytes]) -> bytes:
    return b"".join(keys)


