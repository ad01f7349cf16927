"""Tier-aware KV events in vLLM's format, for prefix-aware routers (docs/events.md).

    base.py       the seam: ``EventSink`` (describe / stored / removed / cleared), ``Medium``,
                  ``EventSpace``, ``NULL_SINK`` (the default: events off)
    hashes.py     the chained per-block hashes events carry, reproducible from a prompt
    wire.py       vLLM's ``KVEventBatch`` and events as msgspec structs (no vLLM import)
    catalog.py    what was announced where: sink calls in, wire events out
    publisher.py  ``KVEventPublisher``: the sink that publishes over ZMQ PUB, with replay
    router.py     ``PrefixRouter``: per node, the blocks it holds by medium; scores prompts

Only ``publisher.py`` and ``router.py`` import zmq; the tiers import ``base`` alone.
"""
