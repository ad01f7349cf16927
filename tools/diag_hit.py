"""Diagnose one kvdepot hit in the reference runtime on CUDA: where its TTFT goes (torch.profiler).

    python tools/diag_hit.py [--length 4096] [--pool-extra 64]
"""
import argparse
import random

from torch.profiler import ProfilerActivity, profile

from kvdepot.integrations.tensorrt_llm.adapter import (
    KvDepotConnectorScheduler,
    KvDepotConnectorWorker,
)
from kvdepot.integrations.tensorrt_llm.providers import current_engine
from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs

ap = argparse.ArgumentParser()
ap.add_argument("--length", type=int, default=4096)
ap.add_argument("--pool-extra", type=int, default=64)
ap.add_argument("--model", default="llama-8b")
a = ap.parse_args()
rng = random.Random(0)
pool = a.length + a.pool_extra
eng = Engine(a.model, device="cuda", llm_args=TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=32, max_tokens=pool)),
             connector=(KvDepotConnectorScheduler, KvDepotConnectorWorker), seed=0)
current_engine().wait_arena()
print("pinned arena:", current_engine().host.pin_memory, "mover:", type(current_engine().mover).__name__)
V = eng.model.config.vocab_size


def prompt(n: int) -> list[int]:
    return [rng.randrange(V) for _ in range(n)]


eng.generate([prompt(512)], 1)
A = prompt(a.length)
print("miss ms", eng.generate([A], 1)[0].ttft_s * 1e3)
for rep in range(3):
    eng.generate([prompt(pool - 1)], 1)
    s0 = current_engine().stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = eng.generate([A], 1)[0]
    s1 = current_engine().stats()
    print(f"hit {rep}: ttft {r.ttft_s*1e3:.1f} ms matched {r.num_connector_matched_tokens} "
          f"load_seconds {1e3*(s1.load_seconds-s0.load_seconds):.1f} ms loaded {s1.bytes_loaded-s0.bytes_loaded}")
    if rep == 1:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
