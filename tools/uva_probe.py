"""Probe: how fast does one Triton kernel move pool blocks straight to/from pinned host memory?

Sweeps the kernel's launch shape (programs, words per tile, warps) for a pool of TensorRT-LLM's
layout, block ids in random order, against one plain pinned copy of the same bytes timed in the
same run (paired, median of ratios), in each direction and both at once. Also times a bf16
matmul alone and beside each kind of transfer: a kernel that copies occupies SMs, a DMA does not.
Every measured move is checked byte for byte. GPU only:

    python3 tools/uva_probe.py [--layers 16 --head-dim 64 --tokens-per-block 8 --tokens 8192]
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import triton
import triton.language as tl


# The kernel measured here: persistent programs walk (segment, tile) units; each unit copies one
# tile of a segment between two addresses (pool <-> mapped pinned host memory). Not shipped: in
# the engine it lost to the DMA movers on every row (docs/perf-notes.md, run O).
@triton.jit
def copy_segments(
    table,  # int64 [n_segments, 2]: source address, destination address (bytes)
    n_units,  # n_segments * tiles_per_segment
    tiles_per_segment,
    segment_words,
    WORD: tl.constexpr,  # element type moved per lane (int64 when every address allows it)
    TILE: tl.constexpr,  # words per program per loop step
    EVEN: tl.constexpr,  # segment_words is a multiple of TILE: no masks
    ALIGN: tl.constexpr,  # bytes every address is known to be a multiple of (lets loads vectorize)
):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    lanes = tl.arange(0, TILE)
    for unit in tl.range(pid, n_units, step):
        segment = unit // tiles_per_segment
        at = (unit % tiles_per_segment).to(tl.int64) * TILE
        src_addr = tl.multiple_of(tl.load(table + 2 * segment), ALIGN)
        dst_addr = tl.multiple_of(tl.load(table + 2 * segment + 1), ALIGN)
        src = src_addr.to(tl.pointer_type(WORD)) + at + lanes
        dst = dst_addr.to(tl.pointer_type(WORD)) + at + lanes
        if EVEN:
            tl.store(dst, tl.load(src))
        else:
            mask = at + lanes < segment_words
            tl.store(dst, tl.load(src, mask=mask), mask=mask)



def _batch_copier(probe_dst: int, probe_src: int, stream: int):
    """cuMemcpyBatchAsync, one call for many copies: the first of several ways to call it that
    copies ``probe_src`` -> ``probe_dst`` (64 bytes) without an error."""
    import ctypes

    import numpy as np

    lib = ctypes.CDLL("libcuda.so.1")

    class Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Attrs(ctypes.Structure):
        _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", Loc), ("dstLocHint", Loc), ("flags", ctypes.c_uint)]

    def ctypes_way(symbol: str, fail_idx: bool, attrs: Attrs):
        fn = getattr(lib, symbol)
        zero = (ctypes.c_size_t * 1)(0)
        failed = ctypes.c_size_t(0)

        def run(dsts, srcs, size, stream):
            d = np.asarray(dsts, dtype=np.uint64)
            s = np.asarray(srcs, dtype=np.uint64)
            z = np.full(len(d), size, dtype=np.uint64)
            head = (d.ctypes.data_as(ctypes.c_void_p), s.ctypes.data_as(ctypes.c_void_p),
                    z.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(len(d)), ctypes.byref(attrs), zero,
                    ctypes.c_size_t(1))
            rc = fn(*head, ctypes.byref(failed), ctypes.c_void_p(stream)) if fail_idx else fn(*head, ctypes.c_void_p(stream))
            if rc != 0:
                raise RuntimeError(f"{symbol}: CUresult {rc}")
        return run

    def bindings_way():
        from cuda.bindings import driver as cu

        attr = cu.CUmemcpyAttributes()
        attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM

        def run(dsts, srcs, size, stream):
            n = len(dsts)
            res = cu.cuMemcpyBatchAsync([cu.CUdeviceptr(x) for x in dsts], [cu.CUdeviceptr(x) for x in srcs],
                                        [size] * n, n, [attr], [0], 1, cu.CUstream(stream))
            err = res[0] if isinstance(res, tuple) else res
            if int(err) != 0:
                raise RuntimeError(f"cuda.bindings cuMemcpyBatchAsync: {err}")
        return run

    ways = []
    for hints in ((0, 0, 0, 0), (1, 0, 2, 0), (2, 0, 1, 0)):
        attrs = Attrs(1, Loc(hints[0], hints[1]), Loc(hints[2], hints[3]), 0)
        ways += [(f"ctypes _v2 hints {hints}", lambda a=attrs: ctypes_way("cuMemcpyBatchAsync_v2", False, a)),
                 (f"ctypes v1 hints {hints}", lambda a=attrs: ctypes_way("cuMemcpyBatchAsync", True, a))]
    ways.append(("cuda.bindings", bindings_way))
    for name, make in ways:
        try:
            run = make()
            run([probe_dst], [probe_src], 64, stream)
            torch.cuda.synchronize()
            print(f"batched copies via {name}")
            return run
        except Exception as exc:  # noqa: BLE001 - a probe: report and try the next way
            print(f"  {name}: {exc}")
    raise RuntimeError("no way to call cuMemcpyBatchAsync worked")


def timed(fn, stream: torch.cuda.Stream) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        fn()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--batch", action="store_true",
                   help="only cuMemcpyBatchAsync: one driver call issuing a DMA copy per block; then both directions in growing windows from one thread, interleaved, and from two threads")
    p.add_argument("--hybrid", action="store_true",
                   help="only both-at-once with one direction by kernel and the other by DMA copy")
    args = p.parse_args()
    dev = torch.device("cuda")
    elems = args.kv_heads * args.tokens_per_block * args.head_dim
    n = args.tokens // args.tokens_per_block
    pool = torch.empty((3 * n, args.layers, 2, elems), dtype=torch.bfloat16, device=dev)
    pool.view(torch.int16).random_(-(2**15), 2**15 - 1)
    seg = pool[0].numel() * 2
    pool_bytes = pool.view(torch.uint8).view(pool.shape[0], seg)
    nbytes = n * seg
    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_in.view(torch.int16).random_(-(2**15), 2**15 - 1)
    plain_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    plain_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    rng = random.Random(0)
    ids = rng.sample(range(pool.shape[0]), n)
    ids_in = rng.sample(range(pool.shape[0]), n)
    print(f"block {seg >> 10} KiB, {n} blocks, {nbytes / 2**20:.0f} MiB per op")

    def table(src_rows, dst_rows):
        return torch.tensor(list(zip(src_rows, dst_rows, strict=True)), dtype=torch.int64).to(dev)

    base = pool_bytes.data_ptr()
    out_table = table([base + b * seg for b in ids], [host_out.data_ptr() + i * seg for i in range(n)])
    in_table = table([host_in.data_ptr() + i * seg for i in range(n)], [base + b * seg for b in ids_in])
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def launch(tab, ctas, tile, warps):
        words = seg // 8
        tiles = triton.cdiv(words, tile)
        copy_segments[(ctas,)](tab, n * tiles, tiles, words, WORD=tl.int64, TILE=tile,
                               EVEN=words % tile == 0, ALIGN=16, num_warps=warps)

    def plain_d2h():
        plain_host.copy_(plain_dev, non_blocking=True)

    def plain_h2d():
        plain_dev.copy_(plain_host, non_blocking=True)

    def both_plain():
        with torch.cuda.stream(s1):
            plain_d2h()
        with torch.cuda.stream(s2):
            plain_h2d()

    def ratio(fn, ceiling) -> float:
        with torch.cuda.stream(s1):  # warm-up (compile, caches), never on the legacy default stream
            fn(); ceiling()  # noqa: E702
        torch.cuda.synchronize()
        rs = []
        for _ in range(args.reps):
            t = timed(fn, s1)
            c = timed(ceiling, s1)
            rs.append(c / t)
        return statistics.median(rs)

    def check(ctas, tile, warps) -> None:
        host_out.zero_()
        launch(out_table, ctas, tile, warps)
        torch.cuda.synchronize()
        assert torch.equal(host_out.view(n, seg), pool_bytes[ids].cpu()), "store bytes differ"
        launch(in_table, ctas, tile, warps)
        torch.cuda.synchronize()
        assert torch.equal(pool_bytes[ids_in].cpu(), host_in.view(n, seg)), "load bytes differ"

    def both_uva(ctas, tile, warps):
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(s1)
        with torch.cuda.stream(s1):
            launch(out_table, ctas, tile, warps)
        with torch.cuda.stream(s2):
            launch(in_table, ctas, tile, warps)
        s1.wait_stream(s2)

    def both_ceiling():
        s2.wait_stream(s1)
        both_plain()
        s1.wait_stream(s2)

    if args.batch:
        batch = _batch_copier(host_out.data_ptr(), base, s1.cuda_stream)
        src_out = [base + b * seg for b in ids]
        dst_out = [host_out.data_ptr() + i * seg for i in range(n)]
        src_in = [host_in.data_ptr() + i * seg for i in range(n)]
        dst_in = [base + b * seg for b in ids_in]

        def b_store():
            batch(dst_out, src_out, seg, torch.cuda.current_stream().cuda_stream)

        def b_load():
            batch(dst_in, src_in, seg, torch.cuda.current_stream().cuda_stream)

        def b_both():
            s2.wait_stream(s1)
            with torch.cuda.stream(s1):
                b_store()
            with torch.cuda.stream(s2):
                b_load()
            s1.wait_stream(s2)

        stream = s1.cuda_stream
        batch(dst_out, src_out, seg, stream)
        torch.cuda.synchronize()
        host_out.zero_()
        with torch.cuda.stream(s1):  # not the legacy default stream: the batch call refuses it
            b_store()
        torch.cuda.synchronize()
        assert torch.equal(host_out.view(n, seg), pool_bytes[ids].cpu()), "batched store bytes differ"
        with torch.cuda.stream(s1):
            b_load()
        torch.cuda.synchronize()
        assert torch.equal(pool_bytes[ids_in].cpu(), host_in.view(n, seg)), "batched load bytes differ"
        import time
        t = time.perf_counter()
        with torch.cuda.stream(s1):
            for _ in range(10):
                b_store()
        issue = (time.perf_counter() - t) / 10
        torch.cuda.synchronize()
        print(f"batched DMA per block: store {ratio(b_store, plain_d2h):.3f} load {ratio(b_load, plain_h2d):.3f} "
              f"both {ratio(b_both, both_ceiling):.3f}; one call issues {n} copies in {issue * 1e6:.0f} us", flush=True)
        # Both directions in the engine's growing windows, issued three ways: is a store issued by a
        # second thread while the caller issues a load held back by the driver itself?
        from concurrent.futures import ThreadPoolExecutor

        import numpy as np

        from kvdepot.transfer.batch import FIRST_WINDOW_BYTES, WINDOW_BYTES, window_bounds

        bounds = window_bounds(np.full(n, seg, dtype=np.int64), WINDOW_BYTES, FIRST_WINDOW_BYTES)

        def issue(dsts, srcs, stream):
            for lo, hi in bounds:
                batch(dsts[lo:hi], srcs[lo:hi], seg, stream.cuda_stream)

        def one_thread():  # the store's windows, then the load's
            s2.wait_stream(s1)
            issue(dst_out, src_out, s1)
            issue(dst_in, src_in, s2)
            s1.wait_stream(s2)

        def interleaved():  # one thread, the two directions' windows alternately
            s2.wait_stream(s1)
            for lo, hi in bounds:
                batch(dst_out[lo:hi], src_out[lo:hi], seg, s1.cuda_stream)
                batch(dst_in[lo:hi], src_in[lo:hi], seg, s2.cuda_stream)
            s1.wait_stream(s2)

        issuers = ThreadPoolExecutor(2, initializer=torch.cuda.synchronize)  # binds the context to each thread

        def two_threads():  # the store from one thread, the load from another, at once
            s2.wait_stream(s1)
            jobs = [issuers.submit(issue, dst_out, src_out, s1), issuers.submit(issue, dst_in, src_in, s2)]
            for job in jobs:
                job.result()
            s1.wait_stream(s2)

        print(f"both, growing windows ({len(bounds)} calls per direction): one thread {ratio(one_thread, both_ceiling):.3f} "
              f"interleaved {ratio(interleaved, both_ceiling):.3f} two threads {ratio(two_threads, both_ceiling):.3f}",
              flush=True)
        issuers.shutdown()
        return
    if args.hybrid:
        def kernel_load_dma_store(cfg):
            s2.wait_stream(s1)
            with torch.cuda.stream(s1):
                plain_d2h()
            with torch.cuda.stream(s2):
                launch(in_table, *cfg)
            s1.wait_stream(s2)

        def kernel_store_dma_load(cfg):
            s2.wait_stream(s1)
            with torch.cuda.stream(s1):
                launch(out_table, *cfg)
            with torch.cuda.stream(s2):
                plain_h2d()
            s1.wait_stream(s2)

        for cfg in [(16, 1024, 8), (32, 1024, 8), (64, 2048, 8), (132, 2048, 8)]:
            a = ratio(lambda cfg=cfg: kernel_load_dma_store(cfg), both_ceiling)
            b = ratio(lambda cfg=cfg: kernel_store_dma_load(cfg), both_ceiling)
            print(f"both at once, {cfg}: kernel load + DMA store {a:.3f}, kernel store + DMA load {b:.3f}", flush=True)
        return
    print(f"{'ctas':>5} {'tile':>5} {'warps':>5} {'store':>6} {'load':>6} {'both':>6}")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    configs = [(sms, t, w) for t in (512, 1024, 2048) for w in (4, 8, 16)]
    configs += [(c, 1024, 8) for c in (8, 16, 32, 64, 2 * sms, 4 * sms)]
    results = {}
    for cfg in configs:
        ctas, tile, warps = cfg
        check(*cfg)
        st = ratio(lambda cfg=cfg: launch(out_table, *cfg), plain_d2h)
        ld = ratio(lambda cfg=cfg: launch(in_table, *cfg), plain_h2d)
        bo = ratio(lambda cfg=cfg: both_uva(*cfg), both_ceiling)
        results[cfg] = (st, ld, bo)
        print(f"{ctas:>5} {tile:>5} {warps:>5} {st:6.3f} {ld:6.3f} {bo:6.3f}", flush=True)

    # What a copying kernel costs the compute beside it (a DMA uses no SMs).
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)

    def matmuls():
        for _ in range(20):
            a @ a

    matmuls(); torch.cuda.synchronize()  # noqa: E702
    alone = statistics.median(timed(matmuls, s2) for _ in range(3))
    print(f"matmul alone {alone * 1e3:.1f} ms")
    for label, fn in [("dma d2h", plain_d2h)] + [
        (f"uva store ctas={c}", (lambda c=c: launch(out_table, c, 1024, 8))) for c in (8, 16, 32, sms)
    ]:
        def beside(fn=fn):
            with torch.cuda.stream(s1):
                for _ in range(max(1, int(alone / 0.005))):
                    fn()
        s1.wait_stream(torch.cuda.current_stream())
        beside()
        t = timed(matmuls, s2)
        torch.cuda.synchronize()
        print(f"matmul beside {label}: {t / alone:.3f}x", flush=True)


if __name__ == "__main__":
    main()
