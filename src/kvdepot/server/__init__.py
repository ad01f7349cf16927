"""Multi-process mode: a cache server that owns the host tier, and the client engines use.

    protocol   the typed wire protocol (msgspec Structs, frozen operation ids, version handshake)
    wire       framing: encode/decode/validate ZMQ frames
    paths      the default per-user ipc:// URL
    ipc        sharing a KV pool with the server (CUDA IPC, shared file, or bytes)
    shard      model groups and per-rank engines;  session   one client's state on the server
    service    the handlers;  server   the ZMQ ROUTER loop;  metrics   Prometheus
    client     DepotClient (timeouts, reconnect) and print_stats;  remote   RemoteEngine

See docs/server.md. Import the submodules you need: this package imports nothing itself.
"""
