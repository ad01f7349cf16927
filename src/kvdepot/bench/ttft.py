"""``kvdepot bench ttft``: time to first token of the reference runtime with kvdepot connected.

Per prompt length L (a Llama-3.1-8B-shaped model with random bf16 weights by default):

    recompute      prompt A computed from scratch (a miss: kvdepot saves it meanwhile)
    kvdepot hit    A again after a filler prompt evicted it from the engine's pool
    device hit     A once more, still in the engine's pool: one forward over the last block
    partial hit    A + S (``--suffix`` new tokens, a chat's next turn) after another filler:
                   kvdepot loads A, the engine computes S
    suffix only    A + S' with A still in the engine's pool: S' alone computed, the partial
                   hit's floor

in each of the ``--modes``: ``in-process`` (the default config: a hit is copied layer by layer
where it can be, each layer's forward waiting only for its own KV), ``whole`` (in-process with
``load_by_layer: off``: the forward waits for the whole hit), and ``mp``, through a ``kvdepot
server`` subprocess that maps the engine's pool by CUDA IPC and does the copies (by layer too),

Each hit's and device hit's TTFT is split (``bench/forward_marks.py``): host time ``before`` the
forward that gave the token, then the device's time ``to layer 0`` (past its load's wait) and for
the whole ``forward``: where a hit's time above its device hit went, before the forward or in it;
inside it, the device's median ``ms/layer`` against the device hit's, and how many layers the
host paced (the device passed their marks as soon as the host enqueued them).

``--repeats N`` times N hits and device hits per length, each after its own filler: a row shows
the try whose hit is the median, with the hits' range (single TTFTs moved by 5-25% between runs
on GPU hosts). With both ``in-process`` and ``mp``, a last table gives MP over in-process per
length (medians over the rounds), raw and with each hit over its own engine's device hit.
``--layers-ahead`` and ``--layer-thread`` (config ``load_layers_ahead``, ``load_layer_thread``)
take several values. ``--rounds N`` measures every mode and variant in turn in one process, N
times, every other round in reverse order, so that the host's phase lands on all of them (a
single MP/in-process figure at 4K moved from 0.906 to 1.605 between runs). The MP server runs
from the first round to the last, and each round's prompts are new to it.

And the target the issue sets, from figures measured in this run:
``bound = 1.2 x KV bytes / memcpy GB/s + device-hit TTFT``. A 0%-reuse run (distinct prompts)
with and without the connector gives the miss overhead on TTFT and on decode throughput, and the
share of the connected runs' wall time spent inside the connector's calls (what a miss can cost
at most: its copies run off the forward stream).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch

from kvdepot.bench.common import device_name, memcpy_ceiling, positive
from kvdepot.bench.connector_clock import ConnectorClock
from kvdepot.bench.forward_marks import ForwardMarks
from kvdepot.bench.report import Report
from kvdepot.bench.ttft_first import add_first_arguments, first_hit_rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu", help="cuda (default when available) or cpu")
    parser.add_argument("--model", default="llama-8b" if cuda else "small", type=_model_arg,
                        help="runtime preset (" + ", ".join(_preset_names()) + ") or a Llama checkpoint dir; "
                             "random weights for presets")
    parser.add_argument("--lengths", default="4096,16384,32768" if cuda else "1024,2048", help="comma-separated prompt lengths")
    parser.add_argument("--miss-prompts", type=int, default=8,
                        help="distinct prompts in the 0%%-reuse run (each served with and without the connector)")
    parser.add_argument("--miss-length", type=int, default=4096 if cuda else 512, help="prompt length of the 0%%-reuse run")
    parser.add_argument("--decode-tokens", type=int, default=32, help="new tokens in the 0%%-reuse run")
    parser.add_argument("--suffix", type=int, default=1024 if cuda else 64, help="new tokens after the cached prefix in the partial-hit rows")
    parser.add_argument("--modes", default="in-process,whole,mp" if cuda else "in-process",
                        help="connector modes for the hit rows: " + ", ".join(MODES))
    parser.add_argument("--layers-ahead", default=None, metavar="N[,N...]",
                        help="layered loads: config load_layers_ahead, layers enqueued at once and by a wait ahead of "
                             "the layer thread (default: the engine's); several values are measured alternately in one process, --rounds times")
    parser.add_argument("--layer-thread", default=None, metavar="on|off[,...]", type=_switches,
                        help="layered loads in-process: config load_layer_thread (default: the engine's); on,off "
                             "measures both alternately in one process, --rounds times")
    add_first_arguments(parser)
    parser.add_argument("--rounds", type=positive, default=1,
                        help="rounds over the hit modes and variants (--layers-ahead, --layer-thread values), "
                             "every other round reversed, the MP server up throughout")
    parser.add_argument("--repeats", type=positive, default=1,
                        help="hits (and device hits) per prompt length, each after its own filler; a row shows the "
                             "one whose hit is the median, and the hits' range")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of TTFT vs prompt length here "
                        "(needs matplotlib: pip install 'kvdepot[bench]')")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON here")


MODES = ("in-process", "whole", "mp", "first-redis")  # whole: loads by layer off; first-redis: ttft_first.py


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _engine(args: argparse.Namespace, max_tokens: int, connected: bool, server_url: str | None = None,
            warmup: bool | None = None):
    from kvdepot.runtime import Engine, KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs
    from kvdepot.runtime.llm_args import MainKvCacheConnectorConfig

    module = "kvdepot.integrations.tensorrt_llm." + ("mp_adapter" if server_url else "adapter")
    prefix = "KvDepotMP" if server_url else "KvDepot"
    names = dict(connector_module=module, connector_scheduler_class=prefix + "ConnectorScheduler",
                 connector_worker_class=prefix + "ConnectorWorker")
    # server_url in the connector config is main's wider model (1.2 users set KVDEPOT_SERVER_URL).
    connector = (MainKvCacheConnectorConfig(**names, server_url=server_url) if server_url
                 else KvCacheConnectorConfig(**names))
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=32, max_tokens=max_tokens),
                            kv_connector_config=connector if connected else None)
    return Engine(args.model, device=args.device, llm_args=llm_args, seed=0, warmup=warmup)


def _ready(server_url: str | None) -> None:
    """Wait until the connector's engine is usable: the arena pinned, or the server registration made."""
    from kvdepot.bench.server_proc import arena_allocated
    from kvdepot.integrations.tensorrt_llm.providers import current_engine, current_remote

    if server_url is None:
        current_engine().wait_arena()  # steady state: a serving engine has pinned its arena long ago
        return
    deadline = time.monotonic() + 120  # a cold server initializes CUDA and maps the pool first
    while current_remote() is None:
        if time.monotonic() > deadline:
            raise RuntimeError("the MP connector did not register with the kvdepot server in 120 s")
        time.sleep(0.1)
    # The server pins its arena from registration on; pinning tens of GB beside the timed phase
    # slowed the whole runtime (a device-hit TTFT of 54 ms against 29), as wait_arena avoids in-process.
    deadline = time.monotonic() + 300
    while not arena_allocated(current_remote().stats()):
        if time.monotonic() > deadline:
            raise RuntimeError("the kvdepot server did not allocate its host arena in 300 s")
        time.sleep(0.2)


def _teardown() -> None:
    from kvdepot.integrations.tensorrt_llm.providers import destroy_engine

    destroy_engine()  # in either mode (and the server connections)


def _hits(args: argparse.Namespace, lengths: list[int], h2d: float, mode: str, server_url: str | None = None,
          add: Callable[[dict], object] = lambda row: row, layers_ahead: int | None = None,
          layer_thread: bool | None = None, salt: int = 0) -> list[dict]:
    """The hit rows of one mode, each passed to ``add`` as soon as it is measured; ``whole`` is
    in-process with loads by layer off, ``layers_ahead`` and ``layer_thread`` set config
    ``load_layers_ahead`` and ``load_layer_thread`` (the engine reads its config from the
    environment when the connector creates it), ``salt``: see ``_hit_rows``."""
    env = {"KVDEPOT_LOAD_BY_LAYER": "off"} if mode == "whole" else {}
    if layers_ahead is not None:
        env["KVDEPOT_LOAD_LAYERS_AHEAD"] = str(layers_ahead)
    if layer_thread is not None:
        env["KVDEPOT_LOAD_LAYER_THREAD"] = "true" if layer_thread else "false"
    with mock.patch.dict(os.environ, env):
        return _hit_rows(args, lengths, h2d, mode, server_url, add, salt)


def _hit_rows(args: argparse.Namespace, lengths: list[int], h2d: float, mode: str, server_url: str | None,
              add: Callable[[dict], object], salt: int = 0) -> list[dict]:
    """One engine's hit rows. ``salt`` (a round) makes its prompts new to a server that served an
    earlier round: a prompt it still held would load where a miss is timed."""
    s = 1_000_000 * salt  # every prompt seed below is under a million
    _teardown()
    pool = max(lengths) + args.suffix + 64
    eng = _engine(args, pool, connected=True, server_url=server_url)
    _ready(server_url)
    vocab = eng.model.config.vocab_size
    kv_per_token = eng.pool[0].numel() * eng.pool.element_size() / eng.tokens_per_block
    # Warm-up: kernels, allocator, streams, and one hit — a process's first load pays one-time
    # costs (~60 ms measured on the H200) that a serving engine pays once, not per request.
    warm = _prompt(min(512, pool - 64), s + 7, vocab)
    eng.generate([warm], 1)
    eng.generate([_prompt(pool - 1, s + 8, vocab)], 1)
    eng.generate([warm], 1)
    # ... and a forward over a suffix of the partial rows' size after a hit: in run Q the first
    # such forward of a process took ~10 ms longer at 4K, whether its hit loaded whole or by layer.
    eng.generate([_prompt(pool - 1, s + 9, vocab)], 1)
    eng.generate([warm + _prompt(args.suffix, s + 10, vocab)], 1)
    rows = []
    for i, n in enumerate(lengths):
        a = _prompt(n, s + 100 + i, vocab)
        miss = eng.generate([a], 1)[0]
        tries = [_hit_and_device(eng, a, pool, vocab, s + 200 + i + 1000 * r, server_url) for r in range(args.repeats)]
        # The row shows the try whose hit is the median (the lower one of an even count): its split
        # and pace are that try's own. A single TTFT moved by 5-20% with the host's phase (issue 19).
        tries.sort(key=lambda t: t["hit"].ttft_s)
        mid = tries[(len(tries) - 1) // 2]
        hit, device, hooks, layered, asks = mid["hit"], mid["device"], mid["hooks"], mid["layered"], mid["asks"]
        if len({t["hit"].num_connector_matched_tokens for t in tries}) > 1:
            raise RuntimeError(f"hits of {n} loaded different lengths: "
                               f"{[t['hit'].num_connector_matched_tokens for t in tries]}")
        eng.generate([_prompt(pool - 1, s + 250 + i, vocab)], 1)
        partial = eng.generate([a + _prompt(args.suffix, s + 400 + i, vocab)], 1)[0]
        floor = eng.generate([a + _prompt(args.suffix, s + 500 + i, vocab)], 1)[0]  # A's blocks reused in the pool
        if partial.num_connector_matched_tokens != n or floor.num_device_reused_tokens != n:
            raise RuntimeError(f"partial hit of {n}: loaded {partial.num_connector_matched_tokens}, "
                               f"then reused {floor.num_device_reused_tokens} on the device")
        split, floor_split = mid["hit_marks"].split(), mid["device_marks"].split()
        pace, floor_pace = mid["hit_marks"].pace(), mid["device_marks"].pace()
        loaded = hit.num_connector_matched_tokens
        bound = 1.2 * loaded * kv_per_token / (h2d * 1e9) + device.ttft_s
        rows.append({
            "mode": mode,
            "prompt": n,
            "recompute ms": miss.ttft_s * 1e3,
            "kvdepot hit ms": hit.ttft_s * 1e3,
            "device hit ms": device.ttft_s * 1e3,
            "repeats": len(tries),
            "hit ms min": tries[0]["hit"].ttft_s * 1e3,
            "hit ms max": tries[-1]["hit"].ttft_s * 1e3,
            "device ms median": statistics.median(t["device"].ttft_s for t in tries) * 1e3,
            "tokens loaded": loaded,
            "KV MB": loaded * kv_per_token / 1e6,
            "bound ms": bound * 1e3,
            "hit/bound": hit.ttft_s / bound,
            "speed-up": miss.ttft_s / hit.ttft_s,
            "by layer": layered > 0,  # the hit was loaded by layer (the engine counted it)
            "hooks ms": hooks.seconds * 1e3,  # in wait_for_layer_load: in-process its copies' issue, MP waits
            "LAYERS calls": asks,  # MP: round trips to learn that layers were recorded (0 with the progress page)
            # Where the hit's time went against its device hit's (bench/forward_marks.py): host time
            # before the forward, the device's time to get past layer 0's wait, and the forward's.
            "hit: before ms": split["before ms"], "hit: to layer 0 ms": split["to layer 0 ms"],
            "hit: forward ms": split["forward ms"],
            "device: before ms": floor_split["before ms"], "device: forward ms": floor_split["forward ms"],
            # Who paced the hit's forward past its layers' waits: the copies (ms/layer above the
            # device hit's, the host ahead) or the host (its marks passed as soon as enqueued).
            "hit: ms/layer": pace["ms/layer"], "device: ms/layer": floor_pace["ms/layer"],
            "hit: host-paced layers": pace["host-paced layers"],
            "hit==device bitwise": all(bool(torch.equal(t["hit"].logits[0], t["device"].logits[0])) for t in tries),
            "tokens==recompute": all(t["hit"].output_ids == miss.output_ids for t in tries),
            f"+{args.suffix} partial hit ms": partial.ttft_s * 1e3,
            "suffix only ms": floor.ttft_s * 1e3,
            "partial/(suffix+load)": partial.ttft_s / (floor.ttft_s + n * kv_per_token / (h2d * 1e9)),
        })
        add(rows[-1])
    if server_url is None:
        from kvdepot.integrations.tensorrt_llm.providers import current_engine

        stats = current_engine().stats()
        assert stats.live_leases == 0, stats
    _teardown()
    del eng
    _free()
    return rows


def _hit_and_device(eng, prompt: list[int], pool: int, vocab: int, seed: int, server_url: str | None) -> dict:
    """One try of a prompt already stored: a filler evicts it from the engine's pool, then the
    kvdepot hit (its marks and hooks timed, its loads counted), then the device hit."""
    eng.generate([_prompt(pool - 1, seed, vocab)], 1)  # evicts the prompt from the engine's pool
    layered, asks = _layered_loads(server_url), _layer_asks()
    with ConnectorClock({"worker": ("wait_for_layer_load",)}) as hooks, ForwardMarks(eng) as hit_marks:
        hit = eng.generate([prompt], 1)[0]  # (hooks: the forward's host time in its hooks)
    layered, asks = _layered_loads(server_url) - layered, _layer_asks() - asks
    with ForwardMarks(eng) as device_marks:
        device = eng.generate([prompt], 1)[0]
    return {"hit": hit, "device": device, "hit_marks": hit_marks, "device_marks": device_marks, "hooks": hooks,
            "layered": layered, "asks": asks}


def _layered_loads(server_url: str | None) -> int:
    """Loads issued by layer so far: the in-process engine's count, or the server shards'."""
    from kvdepot.integrations.tensorrt_llm.providers import current_engine, current_remote

    if server_url is None:
        return current_engine().stats().layered_loads
    stats = current_remote().stats()
    return int(sum(shard.figures.get("layered_loads", 0) for shard in stats.shards)) if stats is not None else 0


def _layer_asks() -> int:
    """LAYERS calls the MP connector's engine has sent so far (0 in-process)."""
    from kvdepot.integrations.tensorrt_llm.providers import current_remote

    remote = current_remote()
    return remote.layer_stats.asks if remote is not None else 0


def _misses(args: argparse.Namespace) -> list[dict]:
    """The 0%-reuse cost of the connector: an engine with it and one without, alive side by side,
    serve the same distinct prompts in turn (who goes first alternates), and each prompt's pair
    gives one ratio; the overheads are the medians of those ratios. Two engines run one after the
    other (the earlier design) differed by up to 15% in decode speed on the H200 between runs
    minutes apart: more than the 2% this is meant to resolve."""
    from kvdepot.integrations.tensorrt_llm.providers import current_engine

    _teardown()
    size = args.miss_length + args.decode_tokens + 64
    engines = {False: _engine(args, size, connected=False), True: _engine(args, size, connected=True)}
    _ready(None)
    vocab = engines[False].model.config.vocab_size
    for eng in engines.values():
        eng.generate([_prompt(min(512, args.miss_length), 7, vocab)], 2)  # warm-up
    timings: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    wall = 0.0  # the connected engine's timed runs, first token to last
    with ConnectorClock() as clock:
        for i in range(args.miss_prompts):
            prompt = _prompt(args.miss_length, 300 + i, vocab)
            for connected in ((False, True) if i % 2 == 0 else (True, False)):
                r = engines[connected].generate_sequential([prompt], args.decode_tokens)[0]
                timings[connected].append((r.ttft_s, (args.decode_tokens - 1) / (r.latency_s - r.ttft_s)))
                if connected:  # its stores finish here, not inside the other engine's timed run
                    wall += r.latency_s
                    current_engine().wait_all()
    _teardown()
    del engines
    _free()
    rows = [{"connector": c, "prompt": args.miss_length,
             "TTFT ms": statistics.median(t for t, _ in timings[c]) * 1e3,
             "decode tok/s": statistics.median(d for _, d in timings[c]),
             "TTFT overhead": None, "decode overhead": None, "connector host share": None} for c in (False, True)]
    pairs = list(zip(timings[False], timings[True], strict=True))
    rows[1]["TTFT overhead"] = statistics.median(on[0] / off[0] for off, on in pairs) - 1
    rows[1]["decode overhead"] = 1 - statistics.median(on[1] / off[1] for off, on in pairs)
    rows[1]["connector host share"] = clock.seconds / wall  # of the connected runs' wall time
    return rows


def _switches(value: str) -> list[bool]:
    """``on,off`` -> [True, False] (--layer-thread)."""
    words = [w.strip() for w in value.split(",") if w.strip()]
    if not words or any(w not in ("on", "off") for w in words):
        raise argparse.ArgumentTypeError(f"{value!r}: give on, off or both, comma-separated")
    return [w == "on" for w in words]


def _preset_names() -> list[str]:
    from kvdepot.runtime.weights import all_preset_names

    return all_preset_names()


def _model_arg(value: str) -> str:
    """A preset name (Llama, FP8-KV Llama, MLA) or a checkpoint directory; else a one-line error."""
    if value in _preset_names() or Path(value).is_dir():
        return value
    raise argparse.ArgumentTypeError(f"--model {value!r}: not a preset ({', '.join(_preset_names())}) "
                                     "nor a checkpoint directory")


def _kv_bytes_per_token(args: argparse.Namespace) -> int:
    from kvdepot.runtime.weights import config_from_hf, preset_config

    cfg = preset_config(args.model) if args.model in _preset_names() else config_from_hf(args.model)
    return cfg.kv_bytes_per_token  # FP8 pools: 1 byte an element; MLA: one latent row a layer


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot: matplotlib is not installed; {path} not written)")
        return
    local = [r for r in rows if r["mode"] == "in-process"] or rows
    xs = [r["prompt"] for r in local]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("recompute ms", "recompute"), ("kvdepot hit ms", "kvdepot hit (in-process, by layer where it can)"),
                       ("bound ms", "target bound"), ("device hit ms", "one forward over the last block")):
        ax.plot(xs, [r[key] for r in local], marker="o", label=label)
    for mode, label in (("whole", "kvdepot hit, whole (in-process)"), ("mp", "kvdepot hit (kvdepot server)")):
        other = [r for r in rows if r["mode"] == mode]
        if other:
            ax.plot([r["prompt"] for r in other], [r["kvdepot hit ms"] for r in other], marker="s", label=label)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(title.replace(", memcpy", "\nmemcpy"), fontsize=9)  # two lines: fits the figure
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; allowed: {', '.join(MODES)}")
    aheads = [int(x) for x in args.layers_ahead.split(",")] if getattr(args, "layers_ahead", None) else [None]
    variants = [(ahead, thread) for ahead in aheads for thread in getattr(args, "layer_thread", None) or [None]]
    local = [m for m in ("in-process", "whole") if m in modes]
    plan = [(ahead, thread, mode) for ahead, thread in variants for mode in local] + \
           ([(None, None, "mp")] if "mp" in modes else [])
    rounds = getattr(args, "rounds", 1) if len(plan) > 1 else 1
    steps = 1 + rounds * len(plan) + ("first-redis" in modes) + 1
    report = Report(args, steps=steps, device=device, name="bench ttft")
    with report.step("memcpy ceiling"):
        h2d, d2h, _both = memcpy_ceiling(256 << 20, device, 5)
    title = f"kvdepot bench ttft — {args.model} on {device_name(device)}, memcpy H2D {h2d:.1f} GB/s D2H {d2h:.1f} GB/s"
    report.table(title, mode=10)

    def add(ahead: int | None, thread: bool | None = None) -> Callable[[dict], object]:
        first = ({} if ahead is None else {"layers ahead": ahead}) | ({} if thread is None else {"layer thread": thread})
        return lambda row: report.add({**first, **row})

    hits = []
    with _server_for(args, lengths, "mp" in modes) as url:
        # Rounds over every mode and variant, every other one reversed, so that a drift of the host
        # lands on all of them alike; the server (if any) runs throughout, idle in the others' turns.
        for r in range(rounds):
            for ahead, thread, mode in plan if r % 2 == 0 else plan[::-1]:
                named = (f", {ahead} layers ahead" if ahead is not None else "") + \
                        (f", layer thread {'on' if thread else 'off'}" if thread is not None else "")
                with report.step(f"hits: {mode}{named}"):
                    hits += _hits(args, lengths, h2d, mode, server_url=url if mode == "mp" else None,
                                  add=add(ahead, thread), layers_ahead=ahead, layer_thread=thread, salt=r)
        if url is not None:
            from kvdepot.server.stats_cmd import print_stats

            print_stats(url)  # the server's tier counters after the MP rows (drops, evictions, pins)
    versus = _mp_over_in_process(hits)
    if versus:
        report.table("server mode (mp) over in-process, the hits' medians (issue 19: within 5%)", prompt=6)
        for row in versus:
            report.add(row)
    first: list[dict] = []
    if "first-redis" in modes:
        report.table("first request of a fresh engine, served from Redis (lower_tier_hits: load)", mode=11)
        with report.step("first hits: redis"):
            first = first_hit_rows(args, lengths, _engine, _ready, _kv_bytes_per_token(args), _free, report.add)
    report.table(f"0% reuse: {args.miss_prompts} distinct prompts of {args.miss_length} tokens, "
                 f"{args.decode_tokens} new tokens each")
    with report.step("0% reuse"):
        misses = [report.add(row) for row in _misses(args)]
    if args.plot:
        _plot(hits, args.plot, title)
    report.args = argparse.Namespace(json=args.json)  # the plot above is this bench's own (TTFT vs length)
    out = {"title": title, "hits": hits, "versus": versus, "first_hits": first, "misses": misses}
    report.finish(out)
    return out


@contextlib.contextmanager
def _server_for(args: argparse.Namespace, lengths: list[int], wanted: bool) -> Iterator[str | None]:
    """A kvdepot server for the MP rows (its URL), or None. It holds the host tier: room for a
    prompt and its filler (a hit must survive the filler's store), and little more, so the arena
    is pinned in the background before the hits."""
    if not wanted:
        yield None
        return
    from kvdepot.bench.server_proc import running_server

    kv_gb = 2.5 * max(lengths) * _kv_bytes_per_token(args) / 1e9
    with running_server("--chunk-size", "256", "--host-capacity-gb", f"{max(kv_gb, 0.05):.3f}") as url:
        yield url


def _mp_over_in_process(hits: list[dict]) -> list[dict]:
    """Per prompt length with in-process and mp rows (one of each per round, none of them a
    variant's): the two modes' hit TTFTs, medians over the rounds, and their ratio; and each hit
    over its own engine's device hit (which takes the host's phase out of the comparison where
    the two ran minutes apart, in different engines)."""
    rows = []
    for n in sorted({r["prompt"] for r in hits}):
        local = [r for r in hits if r["prompt"] == n and r["mode"] == "in-process"
                 and "layers ahead" not in r and "layer thread" not in r]
        mp = [r for r in hits if r["prompt"] == n and r["mode"] == "mp"]
        if not local or len(local) != len(mp):
            continue
        a_hit, b_hit = (statistics.median(r["kvdepot hit ms"] for r in rows_) for rows_ in (local, mp))
        a_dev, b_dev = (statistics.median(r["device ms median"] for r in rows_) for rows_ in (local, mp))
        rows.append({"prompt": n, "repeats": mp[0]["repeats"], "rounds": len(mp), "in-process hit ms": a_hit,
                     "mp hit ms": b_hit, "mp/in-process": b_hit / a_hit, "in-process hit/device": a_hit / a_dev,
                     "mp hit/device": b_hit / b_dev, "mp/in-process, each over its device hit": (b_hit / b_dev) / (a_hit / a_dev)})
    return rows
