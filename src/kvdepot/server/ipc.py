"""Sharing a worker's KV pool with the server: CUDA IPC, a shared file, or bytes on the socket.

Client side:  export_pool(pool, mode) -> ExportedPool   (descriptor for REGISTER + ordering events)
Server side:  open_pool(desc, shape, dtype, allow_shm) -> MappedPool   (a torch view of the pool)

CUDA: TensorRT-LLM's pool is a raw ``cudaMalloc`` buffer, not a torch allocation, so torch's own
sharing cannot export it. We export the *allocation base* (``cuMemGetAddressRange``) with
``cudaIpcGetMemHandle`` plus the pool's offset in it; the server opens it with
``cudaIpcOpenMemHandle`` and wraps it with cupy's ``UnownedMemory`` + ``torch.from_dlpack``.
Two interprocess events order the copies (created ``DisableTiming | Interprocess``):
``to_server`` is recorded by the client on its forward stream before each STORE/RETRIEVE and
waited on by the server's stream before copying; ``to_client`` is recorded by the server after
a load and waited on by the client's forward stream once the reply is in. A cross-layer pool also
exports one event per layer: for a RETRIEVE by layer the server records layer ``l``'s event once
layer ``l`` of every block is copied, and the client's forward waits on each right before that
layer's attention (``ServerLayeredLoad``) — but never before the server has said that layer is
recorded for this load: all of them before the reply, or, for a load answered early, as its
progress page or LAYERS replies tell (``layer_follow``; the server maps the page with the pool and
unmaps it with it). cuda-python and cupy are imported lazily, so CPU-only installs never need them.

CPU: a pool inside a shared file (``torch.from_file(path, shared=True)``, e.g. /dev/shm) is
named by path + offset; the server opens it once (no symlink), checks that descriptor (a regular
file of its own user, large enough) and maps that same descriptor, so the file checked is the
file mapped. Any other CPU pool sends its blocks over the socket ("bytes").
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvdepot.errors import KVDepotError
from kvdepot.server.copy_fence import OPEN, Admission, ServedFence, Ticket, serve_fence
from kvdepot.server.layer_follow import FencedFailure
from kvdepot.server.progress_page import ProgressPage, serve_page
from kvdepot.server.protocol import BytesPool, CudaIpcPool, PoolDesc, ShmPool
from kvdepot.transfer.layered import LayerWaits, TransferFailed

logger = logging.getLogger("kvdepot")

_IPC_HANDLE_BYTES = 64
MAX_LAYER_EVENTS = 1024  # a REGISTER whose pool names more is refused (service.register)


class IpcError(KVDepotError):
    """A pool could not be shared or mapped (no cuda-python, bad handle, file not ours, …)."""


def _cuda() -> tuple[Any, Any]:
    try:
        from cuda.bindings import driver, runtime
    except ImportError as exc:
        raise IpcError(f"CUDA IPC needs cuda-python ('pip install cuda-bindings'): {exc}") from None
    return runtime, driver


def _check(result: tuple, what: str) -> Any:
    err = result[0]
    if int(err) != 0:
        raise IpcError(f"{what} failed: {getattr(err, 'name', err)}")
    return result[1] if len(result) == 2 else result[1:] if len(result) > 2 else None


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_by_uuid(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise IpcError(f"GPU {uuid} is not visible to the server (check CUDA_VISIBLE_DEVICES)")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a KV pool's name: a floating-point type (fp8/fp4 included), int8 or uint8.
    Quantized (``qint8``…), bit, bool, complex and wide integer types are refused: none is a KV
    pool's element type, and some (quantized) cannot even be copied as plain bytes."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype in (torch.int8, torch.uint8)):
        raise IpcError(f"dtype {name[:64]!r} is not a KV cache dtype (a floating-point type, int8 or uint8)")
    return dtype


def _interprocess_event(runtime: Any) -> tuple[Any, bytes]:
    flags = runtime.cudaEventDisableTiming | runtime.cudaEventInterprocess
    event = _check(runtime.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")
    handle = _check(runtime.cudaIpcGetEventHandle(event), "cudaIpcGetEventHandle")
    return event, bytes(handle.reserved)


def _stream_ptr(stream: Any, device: torch.device) -> int:
    return int((stream if stream is not None else torch.cuda.current_stream(device)).cuda_stream)


# ---- client side ----------------------------------------------------------------------------------
class ExportedPool:
    """The client's half of a shared pool: the REGISTER descriptor and the ordering events."""

    def __init__(self, pool: torch.Tensor, desc: PoolDesc, events: tuple[Any, Any] | None = None,
                 layer_events: Sequence[Any] = ()) -> None:
        self.pool, self.desc, self._events = pool, desc, events
        self._layer_events = list(layer_events)
        self.kind = {CudaIpcPool: "cuda", ShmPool: "shm", BytesPool: "bytes"}[type(desc)]

    @property
    def layered(self) -> bool:
        """Whether the server can signal a load layer by layer (a CUDA pool with layer events)."""
        return bool(self._layer_events)

    def layered_load(self, progress: Callable[[int], None] | None = None, ready: int | None = None,
                     ticket: Ticket | None = None) -> ServerLayeredLoad:
        """The waits of a load the server answered ``by_layer``: its layer events are recorded, or,
        with ``progress``, layers ``0..ready-1`` are, and layer ``l`` is once ``progress(l)`` returns.
        ``ticket``: the load's fence ticket, where the server copies on after its reply."""
        return ServerLayeredLoad(self._layer_events, self.pool.device, progress, ready, ticket)

    def before_copy(self, stream: Any) -> bool:
        """Record ``to_server`` on the caller's stream: the server's copy starts after it."""
        if self._events is None:
            return False
        runtime, _ = _cuda()
        _check(runtime.cudaEventRecord(self._events[0], _stream_ptr(stream, self.pool.device)), "cudaEventRecord")
        return True

    def after_load(self, stream: Any) -> None:
        """Make the caller's stream wait for the server's load (call once its reply is in)."""
        if self._events is not None:
            runtime, _ = _cuda()
            ptr = _stream_ptr(stream, self.pool.device)
            _check(runtime.cudaStreamWaitEvent(ptr, self._events[1], 0), "cudaStreamWaitEvent")

    def after_abandoned_load(self, stream: Any) -> None:
        """A load given up on, once the server let go of it (``copy_fence``): make ``stream``
        wait on every event the server may have recorded after that load's copies."""
        self.after_load(stream)
        if self._layer_events:
            runtime, _ = _cuda()
            ptr = _stream_ptr(stream, self.pool.device)
            _check(runtime.cudaStreamWaitEvent(ptr, self._layer_events[-1], 0), "cudaStreamWaitEvent")

    def close(self) -> None:
        if self._events is not None:
            runtime, _ = _cuda()
            for event in (*self._events, *self._layer_events):
                runtime.cudaEventDestroy(event)
            self._events, self._layer_events = None, []


class ServerLayeredLoad(LayerWaits):
    """A load the server copied layer by layer: the client's stream waits on layer ``l``'s
    interprocess event, which the server recorded after layer ``l``'s copies — before its reply,
    or (``progress``) before ``progress(l)`` returns, which raises ``TransferFailed`` where it
    never will be — so a wait never meets an event not yet recorded for this load."""

    def __init__(self, events: Sequence[Any], device: torch.device,
                 progress: Callable[[int], None] | None = None, ready: int | None = None,
                 ticket: Ticket | None = None) -> None:
        super().__init__(len(events))
        self._events, self._device, self._progress = events, device, progress
        self.ready_at_reply = len(events) if ready is None else ready  # layers recorded when the reply came
        self._ticket = ticket  # the load's fence ticket while the server may still copy
        if ticket is not None:
            weakref.finalize(self, ticket.settle)  # a load dropped unfinished frees its slot

    def _wait(self, layer: int, stream: Any) -> None:
        if self._progress is not None:
            try:
                self._progress(layer)
            except FencedFailure:  # the last event follows every copy that went: none lands later
                self._fenced(stream)
                raise
            except TransferFailed as exc:  # nothing says where the server is: let go of it first
                ticket, self._ticket = self._ticket, None
                if ticket is None or not ticket.abandon(wait=True):
                    raise
                self._fenced(stream)
                raise FencedFailure(f"{exc} (the server has let go of the load since)") from exc
        self._wait_event(layer, stream)
        if layer == self.num_layers - 1 and self._ticket is not None:
            self._ticket.settle()  # every layer recorded: the server's copies are all enqueued

    def _fenced(self, stream: Any) -> None:
        """Wait on the last layer's event, recorded after every copy of the load that went."""
        with contextlib.suppress(IpcError):
            self._wait_event(self.num_layers - 1, stream)
        if self._ticket is not None:
            self._ticket.settle()

    def _wait_event(self, layer: int, stream: Any) -> None:
        runtime, _ = _cuda()
        _check(runtime.cudaStreamWaitEvent(_stream_ptr(stream, self._device), self._events[layer], 0), "cudaStreamWaitEvent")


def export_pool(pool: torch.Tensor, mode: str = "auto", layers: int = 0) -> ExportedPool:
    """Describe how the server can reach ``pool``; "auto" picks IPC/shared file, else bytes.
    ``layers``: a CUDA pool gets that many layer events (a cross-layer pool's layer count; 0: none)."""
    if mode not in ("auto", "ipc", "shm", "bytes"):
        raise IpcError(f"pool sharing mode {mode!r} is not one of auto, ipc, shm, bytes")
    if mode == "bytes":
        return ExportedPool(pool, BytesPool())
    try:
        if pool.is_cuda and mode in ("auto", "ipc"):
            return _export_cuda(pool, layers)
        if not pool.is_cuda and mode in ("auto", "shm"):
            return _export_shm(pool)
        raise IpcError(f"mode {mode!r} does not fit a {pool.device.type} pool")
    except IpcError as exc:
        if mode != "auto":
            raise
        log = logger.warning if pool.is_cuda else logger.info  # a plain CPU pool is the expected case
        log("kvdepot: %s; the pool's blocks travel over the socket", exc)
        return ExportedPool(pool, BytesPool())


def _export_cuda(pool: torch.Tensor, layers: int = 0) -> ExportedPool:
    runtime, driver = _cuda()
    index = pool.device.index if pool.device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        _check(driver.cuInit(0), "cuInit")
        base, size = _check(driver.cuMemGetAddressRange(pool.data_ptr()), "cuMemGetAddressRange")
        handle = _check(runtime.cudaIpcGetMemHandle(int(base)), "cudaIpcGetMemHandle")
        to_server, to_server_handle = _interprocess_event(runtime)
        to_client, to_client_handle = _interprocess_event(runtime)
        # one per layer or none (more layers than the server accepts: whole loads only)
        per_layer = [_interprocess_event(runtime) for _ in range(layers if layers <= MAX_LAYER_EVENTS else 0)]
    desc = CudaIpcPool(
        mem_handle=bytes(handle.reserved), offset=pool.data_ptr() - int(base), alloc_bytes=int(size),
        device_uuid=device_uuid(index), to_server_event=to_server_handle, to_client_event=to_client_handle,
        layer_events=tuple(blob for _event, blob in per_layer),
    )
    return ExportedPool(pool, desc, (to_server, to_client), [event for event, _blob in per_layer])


def _export_shm(pool: torch.Tensor) -> ExportedPool:
    storage = pool.untyped_storage()
    path = getattr(storage, "filename", None)
    if not path:
        raise IpcError("CPU pool is not in a shared file (allocate it with shared_cpu_pool or torch.from_file)")
    return ExportedPool(pool, ShmPool(path=str(path), offset=pool.data_ptr() - storage.data_ptr()))


def frame_tensor(buf: Any) -> torch.Tensor:
    """A uint8 tensor over a received (read-only) frame, without a copy; callers only read it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=torch.uint8)


def shared_cpu_pool(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU pool in the shared file ``path`` (created 0600), mappable by the server."""
    nbytes = torch.empty((), dtype=dtype).element_size()
    for dim in shape:
        nbytes *= dim
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


# ---- server side ----------------------------------------------------------------------------------
class MappedPool:
    """The server's view of a worker's pool; ``tensor`` is None for "bytes" pools."""

    def __init__(self, kind: str, tensor: torch.Tensor | None = None, closer: Any = None,
                 events: tuple[Any, Any] | None = None, layer_events: Sequence[Any] = (),
                 file: tuple[str, int, int] | None = None) -> None:
        self.kind, self.tensor, self._closer, self._events = kind, tensor, closer, events
        self.file = file  # a shared file's (path, st_dev, st_ino), as mapped
        self.layer_events = list(layer_events)  # the client's, one per layer (empty: no loads by layer)
        self.progress: ProgressPage | None = None  # where loads by layer publish their progress
        self.fence: ServedFence | None = None  # where the client abandons copies (``copy_fence``)
        self.stream = torch.cuda.Stream(tensor.device) if tensor is not None and tensor.is_cuda else None

    def admit(self, ticket: int, deadline_ns: int) -> Admission:
        """What a copy into or out of this pool enters right before it starts (``copy_fence``)."""
        if self.tensor is None:
            return OPEN
        return self.fence.admit(ticket, deadline_ns) if self.fence is not None else Admission(None, 0, deadline_ns)

    def wait_client(self, synced: bool) -> None:
        """Order the server's next copy after the client's ``to_server`` record."""
        if self._events is not None and synced and self.stream is not None:
            runtime, _ = _cuda()
            _check(runtime.cudaStreamWaitEvent(int(self.stream.cuda_stream), self._events[0], 0), "cudaStreamWaitEvent")

    def signal_client(self) -> None:
        """Record ``to_client`` after the enqueued load: the client's stream waits on it."""
        if self._events is not None and self.stream is not None:
            runtime, _ = _cuda()
            _check(runtime.cudaEventRecord(self._events[1], int(self.stream.cuda_stream)), "cudaEventRecord")

    def signal_layers(self, load: LayerWaits) -> None:
        """Have layer ``l``'s event recorded once ``load``'s layer ``l`` is in, for every layer:
        the load records each as it enqueues the layer (``record_layer_on``, its ``on_layer``),
        so it is only enqueued to the end here (``layer_progress.record_rest``: why there)."""
        load.enqueue_through(len(self.layer_events) - 1)

    def record_layer(self, layer: int) -> None:
        """Record layer ``layer``'s event on this stream: a failed load's fence, after a wait for
        every copy that went (``layer_progress``)."""
        self.record_layer_on(layer, self.stream)

    def record_layer_on(self, layer: int, stream: Any) -> None:
        """Record layer ``layer``'s event on ``stream``: a load's copy stream, right after that
        layer's copies, or this pool's own (``record_layer``)."""
        runtime, _ = _cuda()
        _check(runtime.cudaEventRecord(self.layer_events[layer], int(stream.cuda_stream)), "cudaEventRecord")

    def remove_file(self) -> bool:
        """Unlink the shared file, if its path still names the file that was mapped (never a
        file made there since). True if removed."""
        if self.file is None:
            return False
        path, dev, ino = self.file
        try:
            info = os.stat(path, follow_symlinks=False)
            if (info.st_dev, info.st_ino) != (dev, ino):
                return False
            os.unlink(path)
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Unmap. The caller has made sure no copy into or out of the pool is still running."""
        if self.stream is not None:
            self.stream.synchronize()
        self.tensor, self.stream = None, None
        if self.progress is not None:
            self.progress.close()
        if self.fence is not None:
            self.fence.close()
        closer, self._closer = self._closer, None
        if closer is not None:
            closer()


def open_pool(desc: PoolDesc, shape: tuple[int, ...], dtype: torch.dtype, *, allow_shm: bool) -> MappedPool:
    nbytes = torch.empty((), dtype=dtype).element_size()
    for dim in shape:
        nbytes *= dim
    if isinstance(desc, BytesPool):
        return MappedPool("bytes")
    if isinstance(desc, ShmPool):
        if not allow_shm:
            raise IpcError("shared-file pools are accepted on ipc:// servers only (use bytes over TCP)")
        flat, file = _map_shm(desc, nbytes)
        pool = MappedPool("shm", flat[desc.offset : desc.offset + nbytes].view(dtype).view(shape), file=file)
    else:
        pool = _map_cuda(desc, nbytes, shape, dtype)
        pool.progress = serve_page(desc, allow_shm)
    pool.fence = serve_fence(desc, allow_shm)
    return pool


def _map_shm(desc: ShmPool, nbytes: int) -> tuple[torch.Tensor, tuple[str, int, int]]:
    """The file checked and mapped through one descriptor: what was checked is what is mapped
    (reopening by name would let the path be swapped in between)."""
    try:
        fd = os.open(desc.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise IpcError(f"cannot open shared pool file {desc.path[:256]!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise IpcError(f"shared pool file {desc.path[:256]!r} must be a regular file owned by the server's user")
        if nbytes <= 0 or desc.offset < 0 or desc.offset + nbytes > info.st_size:
            raise IpcError(f"pool of {nbytes} bytes at offset {desc.offset} does not fit {desc.path[:256]!r} "
                           f"({info.st_size} bytes)")
        try:
            memory = mmap.mmap(fd, info.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            raise IpcError(f"cannot map shared pool file {desc.path[:256]!r}: {exc}") from None
    finally:
        os.close(fd)  # the mapping outlives the descriptor
    # The tensor keeps the mapping alive; it is unmapped once the last view of it is gone.
    return torch.frombuffer(memory, dtype=torch.uint8), (desc.path, info.st_dev, info.st_ino)


def _map_cuda(desc: CudaIpcPool, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> MappedPool:
    if not torch.cuda.is_available():
        raise IpcError("the client registered a CUDA pool but the server sees no CUDA device")
    if len(desc.mem_handle) != _IPC_HANDLE_BYTES or desc.offset < 0 or desc.offset + nbytes > desc.alloc_bytes:
        raise IpcError("CUDA IPC descriptor is malformed (handle size, or offset + pool size past the allocation)")
    runtime, _ = _cuda()
    index = device_by_uuid(desc.device_uuid)
    with torch.cuda.device(index):
        handle = runtime.cudaIpcMemHandle_t()
        handle.reserved = desc.mem_handle
        base = int(_check(runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))
        events = []
        try:
            for blob in (desc.to_server_event, desc.to_client_event, *desc.layer_events):
                event_handle = runtime.cudaIpcEventHandle_t()
                event_handle.reserved = blob
                events.append(_check(runtime.cudaIpcOpenEventHandle(event_handle), "cudaIpcOpenEventHandle"))
            flat = _wrap_device_memory(base, desc.alloc_bytes, index)
        except (IpcError, ValueError, TypeError) as exc:
            for event in events:
                runtime.cudaEventDestroy(event)
            runtime.cudaIpcCloseMemHandle(base)
            raise IpcError(f"mapping the CUDA pool failed: {exc}") from None

    def closer() -> None:
        with torch.cuda.device(index):
            for event in events:
                runtime.cudaEventDestroy(event)
            _check(runtime.cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle")

    tensor = flat[desc.offset : desc.offset + nbytes].view(dtype).view(shape)
    return MappedPool("cuda", tensor, closer, (events[0], events[1]), events[2:])


def _wrap_device_memory(ptr: int, nbytes: int, index: int) -> torch.Tensor:
    """A 1-D uint8 torch view of device memory torch did not allocate (nothing is copied)."""
    try:
        import cupy
    except ImportError:
        return torch.as_tensor(_CudaArray(ptr, nbytes), device=torch.device("cuda", index))
    with cupy.cuda.Device(index):
        memory = cupy.cuda.UnownedMemory(ptr, nbytes, None, index)
        array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        return torch.from_dlpack(array)


class _CudaArray:
    """``__cuda_array_interface__`` of a raw device buffer: torch's no-cupy way to wrap it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }
