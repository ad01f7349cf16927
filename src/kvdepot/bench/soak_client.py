"""One client process of ``kvdepot bench soak``: store, look up and load, checking every byte.

    python -m kvdepot.bench.soak_client URL WORKDIR NAME MODE SEED

The KV of a chunk is a pure function of its chunk key (``expected``), so whichever client stored
it, a load can be checked byte for byte without any shared record. Prompts come in families that
share a two-chunk prefix, so loads are often partial. Per operation: LOOKUP with a lease; a hit
is loaded into blocks first filled with a sentinel, and then every block the reply says it loaded
must hold exactly the expected bytes, and every other byte the sentinel or (a server killed
mid-copy) the expected byte; the blocks must then stay as they are until the next load (else:
late bytes, a copy that went on after the client was done). A miss (or a partial hit) is stored. Counts go to ``WORKDIR/NAME.json``, rewritten every half second and
at once when a wrong byte is seen, so a client killed with -9 loses only its last half second of
counts, never a wrong byte. ``WORKDIR/NAME.ready`` appears once it first registered; the process
stops when ``WORKDIR/stop`` exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kvdepot.server.client import DepotClient
from kvdepot.server.ipc import shared_cpu_pool
from kvdepot.server.remote import RemoteEngine

TOKENS_PER_BLOCK, CHUNK = 8, 16
BLOCKS_PER_CHUNK = CHUNK // TOKENS_PER_BLOCK
POOL_SHAPE = (32, 2, 2, 4 * TOKENS_PER_BLOCK * 4)  # 32 blocks of 1 KiB (bfloat16)
DTYPE = torch.bfloat16
PROMPTS, FAMILY = 128, 4  # prompts p and p' share their first two chunks when p // 4 == p' // 4
LOAD_AT = 16  # loads go to blocks 16.., stores come from blocks 0..
SENTINEL = 0xA5


@dataclass
class Counts:
    ops: int = 0  # LOOKUP + STORE + RETRIEVE calls
    lookups: int = 0
    hits: int = 0
    loads: int = 0
    loaded_blocks: int = 0
    checked_bytes: int = 0  # loaded blocks compared with the expected bytes, plus untouched ones
    wrong_bytes: int = 0
    late_bytes: int = 0  # load blocks that changed after their load was over (checked at the next load)
    short_loads: int = 0  # a load that brought fewer tokens than its LOOKUP found in host memory
    stores: int = 0
    stored_chunks: int = 0


def prompt(p: int) -> list[int]:
    """Two chunks shared by the family, then 1..4 chunks of the prompt's own."""
    family = [(p // FAMILY * 7919 + i * 31) % 50000 for i in range(2 * CHUNK)]
    own = [(p * 104729 + i * 17) % 50000 for i in range((1 + p % 4) * CHUNK)]
    return family + own


def expected(key: bytes, nbytes: int) -> np.ndarray:
    """The KV bytes of a chunk: what every client stores under ``key``."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def pool_path(workdir: Path, name: str) -> Path:
    """The shared file of client ``name``'s pool (the soak checks none is left at the end)."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else workdir
    return shm / f"{workdir.name}-{name}"


def _pool(workdir: Path, name: str, mode: str) -> torch.Tensor:
    if mode == "shm":
        return shared_cpu_pool(str(pool_path(workdir, name)), POOL_SHAPE, DTYPE)
    return torch.zeros(POOL_SHAPE, dtype=DTYPE)


def run(url: str, workdir: Path, name: str, mode: str, seed: int) -> Counts:
    rng = random.Random(seed)
    counts = Counts()
    out = workdir / f"{name}.json"
    pool = _pool(workdir, name, mode)
    raw = pool.view(POOL_SHAPE[0], -1).view(torch.uint8)  # one row of bytes per block
    chunk_bytes = BLOCKS_PER_CHUNK * raw.shape[1]
    client = DepotClient(url, timeout_s=2.0, heartbeat_s=0.2, name=f"soak-{name}", log_outages=False)
    engine = RemoteEngine(client, pool, TOKENS_PER_BLOCK, model_id="soak", mode=mode)
    rid, flushed = rng.getrandbits(40), 0.0

    def flush() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(counts)))
        os.replace(tmp, out)

    try:
        while not (workdir / "stop").exists():
            if time.monotonic() - flushed > 0.5:
                flush()
                flushed = time.monotonic()
            if not engine.ready:
                time.sleep(0.05)  # the server is away: the client reconnects and re-registers itself
                continue
            if not counts.ops:
                (workdir / f"{name}.ready").touch()  # the soak's clock starts once every client is in
            rid += 1
            keys = engine.chunk_keys(prompt(rng.randrange(PROMPTS)))
            want = [expected(bytes(k), chunk_bytes) for k in keys]
            hit = engine.probe(keys, lease=rid)
            matched = hit.host_tokens  # promised now (a part still promoted from disk/Redis is not)
            counts.ops += 1
            counts.lookups += 1
            if matched:
                counts.hits += 1
                late = counts.late_bytes
                wrong = _load(engine, raw, keys, rid, matched, want, counts)
                counts.wrong_bytes += wrong
                if wrong or counts.late_bytes > late:
                    flush()  # never lose a wrong byte to a kill
            engine.release(rid)
            if hit.tokens < len(keys) * CHUNK:
                for c, data in enumerate(want):
                    raw[c * BLOCKS_PER_CHUNK : (c + 1) * BLOCKS_PER_CHUNK] = torch.from_numpy(data).view(BLOCKS_PER_CHUNK, -1)
                handle = engine.store(keys, list(range(len(keys) * BLOCKS_PER_CHUNK)))
                handle.wait()
                counts.ops += 1
                counts.stores += 1
                counts.stored_chunks += handle.chunks
    finally:
        flush()
        engine.close()
        client.close()
        storage = pool.untyped_storage()
        path = getattr(storage, "filename", None)
        del pool, raw
        if path:
            Path(path).unlink(missing_ok=True)
    return counts


_last: list[torch.Tensor] = []  # the load blocks as the last load left them


def _load(engine: RemoteEngine, raw: torch.Tensor, keys: list, rid: int, matched: int, want: list[np.ndarray],
          counts: Counts) -> int:
    """Load the hit into sentinel-filled blocks; the number of bytes that are not what they must be."""
    blocks = len(keys) * BLOCKS_PER_CHUNK
    dst = list(range(LOAD_AT, LOAD_AT + blocks))
    late = int(torch.count_nonzero(raw[LOAD_AT:] != _last[0])) if _last else 0
    if late:  # a copy that went on after its reply (or its timeout): the client had moved on
        counts.late_bytes += late
        print(f"{time.time():.3f} {late} bytes written into load blocks after the load was over",
              file=sys.stderr, flush=True)
    raw[LOAD_AT : LOAD_AT + blocks] = SENTINEL
    end = engine.retrieve(keys, dst, lease=rid)
    counts.ops += 1
    counts.loads += 1
    loaded = max(0, end // TOKENS_PER_BLOCK)
    counts.loaded_blocks += loaded
    counts.short_loads += end < matched
    got = raw[LOAD_AT : LOAD_AT + blocks].reshape(-1).numpy()
    wanted = np.concatenate(want)
    row = raw.shape[1]
    wrong = int(np.count_nonzero(got[: loaded * row] != wanted[: loaded * row]))
    # Past the reported end a failed copy (a server killed mid-load) may have written, but only
    # the right bytes: each byte is still the sentinel or what the chunk holds.
    rest, rest_wanted = got[loaded * row :], wanted[loaded * row :]
    wrong += int(np.count_nonzero((rest != SENTINEL) & (rest != rest_wanted)))
    counts.checked_bytes += got.size
    _last[:] = [raw[LOAD_AT:].clone()]
    if wrong:  # what went wrong, for the soak's log: which blocks, and what they hold instead
        rows, want_rows = got.reshape(blocks, row), wanted.reshape(blocks, row)
        bad = [b for b in range(blocks) if not np.array_equal(rows[b], want_rows[b])
               and (b < loaded or ((rows[b] != SENTINEL) & (rows[b] != want_rows[b])).any())]
        kinds = ["sentinel" if (rows[b] == SENTINEL).all() else "zero" if not rows[b].any() else "other" for b in bad]
        print(f"{time.time():.3f} wrong bytes {wrong}: matched {matched} end {end} of {blocks} blocks; "
              f"bad blocks {bad} ({kinds})", file=sys.stderr, flush=True)
    return wrong


def main(argv: list[str]) -> int:
    url, workdir, name, mode, seed = argv[0], Path(argv[1]), argv[2], argv[3], int(argv[4])
    run(url, workdir, name, mode, seed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
