"""``kvdepot.keys``: chained 128-bit chunk keys, identical in every process.

The reference below re-derives keys from the module's stated formula with ``struct`` (explicit
little-endian u32), independently of ``token_bytes``; everything else is a property.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys

import blake3
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import kvdepot
from kvdepot.errors import LayoutError
from kvdepot.keys import KEY_BYTES, ChunkHasher, Namespace, token_bytes

ALGOS = ["xxh3_128", "blake3"]
NS = Namespace(model_id="llama-3-8b", kv_dtype="bfloat16", geometry=(32, 2, 8192, 2, 32), chunk_size=4, cache_salt="s")
tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=40)


def reference_keys(ns: Namespace, algo: str, tokens: list[int]) -> list[bytes]:
    def h(data: bytes) -> bytes:
        return xxhash.xxh3_128_digest(data) if algo == "xxh3_128" else blake3.blake3(data).digest(16)

    blob = json.dumps(dataclasses.asdict(ns), sort_keys=True, separators=(",", ":")).encode()
    prev, out, c = h(b"kvdepot-ns-v1\0" + blob), [], ns.chunk_size
    for i in range(len(tokens) // c):
        prev = h(prev + struct.pack(f"<{c}I", *tokens[i * c : (i + 1) * c]))
        out.append(prev)
    return out


@pytest.mark.parametrize("algo", ALGOS)
@settings(max_examples=50, deadline=None)
@given(tokens=tokens_st)
def test_keys_follow_the_stated_formula_and_are_deterministic(algo, tokens):
    keys = ChunkHasher(NS, algo).chunk_keys(tokens)
    assert keys == reference_keys(NS, algo, tokens)
    assert keys == ChunkHasher(NS, algo).chunk_keys(tokens)  # a second hasher agrees
    assert len(keys) == len(tokens) // NS.chunk_size  # a trailing partial chunk has no key
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)


def test_algorithms_give_different_keys_and_unknown_algo_is_refused():
    tokens = list(range(8))
    assert set(ChunkHasher(NS, "xxh3_128").chunk_keys(tokens)).isdisjoint(ChunkHasher(NS, "blake3").chunk_keys(tokens))
    with pytest.raises(LayoutError, match="sha1"):
        ChunkHasher(NS, "sha1")


# keys.py is engine-free: the child loads it under a bare ``kvdepot`` package, skipping the
# package __init__ (which imports torch), so this test costs a fraction of a second per process.
_CHILD = """
import json, sys, types
package = types.ModuleType("kvdepot")
package.__path__ = [sys.argv[3]]
sys.modules["kvdepot"] = package
from kvdepot.keys import ChunkHasher, Namespace
assert "torch" not in sys.modules
ns = Namespace(**json.loads(sys.argv[1]))
tokens = json.loads(sys.argv[2])
print(json.dumps({a: [k.hex() for k in ChunkHasher(ns, a).chunk_keys(tokens)] for a in ("xxh3_128", "blake3")}))
"""


def test_keys_are_identical_across_processes_whatever_the_hash_seed():
    ns = dataclasses.replace(NS, geometry=(2, 1, 64, 1, 16), model_id="m/ü", cache_salt="tenant")
    tokens = [7, 0, 2**32 - 1, 31337] * 5 + [1, 2]
    fields = json.dumps(dataclasses.asdict(ns))
    expected = {a: [k.hex() for k in ChunkHasher(ns, a).chunk_keys(tokens)] for a in ALGOS}
    children = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        argv = [sys.executable, "-c", _CHILD, fields, json.dumps(tokens), kvdepot.__path__[0]]
        children.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        assert json.loads(out) == expected


NAMESPACE_CHANGES = {
    "model_id": "llama-3-70b",
    "kv_dtype": "float8_e4m3fn",
    "geometry": (32, 2, 8192, 2, 16),
    "chunk_size": 8,
    "tp_rank": 1,
    "tp_size": 2,
    "cache_salt": "t",
}


@pytest.mark.parametrize("field", sorted(NAMESPACE_CHANGES))
@pytest.mark.parametrize("algo", ALGOS)
def test_any_namespace_change_changes_every_key(field, algo):
    tokens = list(range(40))
    base = ChunkHasher(NS, algo).chunk_keys(tokens)
    other = ChunkHasher(dataclasses.replace(NS, **{field: NAMESPACE_CHANGES[field]}), algo).chunk_keys(tokens)
    assert other and set(other).isdisjoint(base)


@settings(max_examples=80, deadline=None)
@given(data=st.data(), algo=st.sampled_from(ALGOS))
def test_changing_token_i_changes_its_chunk_key_and_all_later_ones_only(data, algo):
    tokens = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=30), label="tokens")
    i = data.draw(st.integers(0, len(tokens) - 1), label="i")
    new = data.draw(st.integers(0, 2**32 - 1).filter(lambda t: t != tokens[i]), label="new")
    changed = list(tokens)
    changed[i] = new
    hasher = ChunkHasher(NS, algo)
    before, after = hasher.chunk_keys(tokens), hasher.chunk_keys(changed)
    c = i // NS.chunk_size
    assert before[:c] == after[:c]
    assert all(a != b for a, b in zip(before[c:], after[c:], strict=True))  # empty if i is in the partial tail


@settings(max_examples=80, deadline=None)
@given(tokens=tokens_st, cut=st.integers(0, 40), algo=st.sampled_from(ALGOS))
def test_extend_equals_a_fresh_computation(tokens, cut, algo):
    hasher = ChunkHasher(NS, algo)
    fresh = hasher.chunk_keys(tokens)
    prefix = hasher.chunk_keys(tokens[:cut])
    snapshot = list(prefix)
    assert hasher.extend(prefix, tokens) == fresh
    assert prefix == snapshot  # the caller's list is not mutated
    # Keys for more chunks than the tokens hold are cut back to the tokens' full chunks.
    assert hasher.extend(fresh + [b"x" * 16], tokens[: len(tokens) - len(tokens) % 4]) == fresh


@settings(max_examples=50, deadline=None)
@given(tokens=tokens_st, algo=st.sampled_from(ALGOS))
def test_list_tuple_and_numpy_inputs_agree(tokens, algo):
    hasher = ChunkHasher(NS, algo)
    expected = hasher.chunk_keys(tokens)
    assert hasher.chunk_keys(tuple(tokens)) == expected
    assert hasher.chunk_keys(np.asarray(tokens, dtype=np.int64)) == expected
    assert hasher.chunk_keys(np.asarray(tokens, dtype=np.uint32)) == expected
    assert hasher.chunk_keys(np.asarray(tokens, dtype=">u4")) == expected  # byte order of the input is irrelevant
    assert hasher.chunk_keys([np.uint64(t) for t in tokens]) == expected
    small = [t % 2**31 for t in tokens]
    assert hasher.chunk_keys(np.asarray(small, dtype=np.int32)) == hasher.chunk_keys(small)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, -(2**31)])
@pytest.mark.parametrize("as_numpy", [False, True])
def test_tokens_outside_u32_raise_layout_error(bad, as_numpy):
    tokens = [5] * 7 + [bad]  # inside the second full chunk
    hasher = ChunkHasher(NS)
    with pytest.raises(LayoutError, match=r"2\*\*32"):
        hasher.chunk_keys(np.asarray(tokens, dtype=np.int64) if as_numpy else tokens)
    with pytest.raises(LayoutError):
        token_bytes(np.asarray(tokens, dtype=np.int64) if as_numpy else tokens)


def test_non_integer_tokens_raise_layout_error():
    hasher = ChunkHasher(NS)
    with pytest.raises(LayoutError):
        hasher.chunk_keys([1.5, 2, 3, 4])
    with pytest.raises(LayoutError):
        hasher.chunk_keys(np.asarray([1.5, 2, 3, 4]))  # never silently truncated to 1
    with pytest.raises(LayoutError):
        hasher.chunk_keys(["1", "2", "3", "4"])


def test_bounds_are_inclusive_and_bytes_little_endian():
    assert token_bytes([0, 1, 2**32 - 1]) == b"\0\0\0\0" + b"\1\0\0\0" + b"\xff\xff\xff\xff"
    assert token_bytes(np.asarray([0, 1, 2**32 - 1], dtype=np.uint64)) == token_bytes([0, 1, 2**32 - 1])
    assert ChunkHasher(NS).chunk_keys([]) == []
    assert ChunkHasher(NS).chunk_keys(np.asarray([], dtype=np.int64)) == []
