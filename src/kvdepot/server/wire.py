"""Framing of the protocol's messages: encode, decode and validate ZMQ frames.

    request_frames(op, req_id, msg, payloads) / parse_request(frames)   client -> server
    reply_frames(req_id, msg, payloads) / error_frames(req_id, code, text) / parse_reply_header
    split_keys(blob) / join_keys(keys)                                   16-byte chunk keys

``parse_request`` turns every malformed input into a ``ProtocolError`` carrying the error code
(and the request id when the header could be read), never another exception.
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
    Op,
    OpSpec,
    Payloads,
    ProtocolError,
    ReplyHeader,
    RequestHeader,
)

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


def parse_request(frames: Sequence[Buffer]) -> tuple[RequestHeader, OpSpec, msgspec.Struct, list[Buffer]]:
    """Header, op spec, body and payloads of a request; ``ProtocolError`` for anything malformed."""
    if len(frames) < 2:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"expected [header, body, *payloads], got {len(frames)} frame(s)")
    try:
        header = _header_decoder.decode(frames[0])
    except msgspec.MsgspecError as exc:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"undecodable header: {exc}") from None
    if not 0 <= header.req_id < 2**63:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"request id {header.req_id} out of range")
    spec = OPS.get(header.op)
    if spec is None:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown operation id {header.op}", header.req_id)
    try:
        body = _decoders[spec.request].decode(frames[1])
    except msgspec.MsgspecError as exc:
        name = Op(header.op).name
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"{name}: undecodable body: {exc}", header.req_id) from None
    return header, spec, body, list(frames[2:])


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


