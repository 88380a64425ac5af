"""UCP's one-sided RMA (memory registration, remote keys, put, get, flush) for ucxx
workers; what the puts of a write are, and which lane issues each, is `ucx_puts`.

ucxx 0.52's Python API has no RMA: `ucxx._lib.libucxx` binds tag, stream and active
messages, and its C++ library has `MemoryHandle`, `RemoteKey` and `Endpoint::memGet` /
`memPut`, but none of them is exposed to Python (no `mem_map`, `rkey`, `put` or `get`
anywhere in the bindings). It does expose the raw UCP handles (`UCXContext.handle`,
`UCXWorker.handle`, `UCXEndpoint.handle`), and its workers run in
`UCS_THREAD_MODE_MULTI`. So this module calls libucp (the copy ucxx itself loaded, from
the `libucx` wheel) through ctypes on those handles: `ucp_mem_map` once per cache,
`ucp_rkey_pack` / `ucp_ep_rkey_unpack`, `ucp_put_nbx` per region (a get for wire-up)
and one `ucp_ep_flush_nbx` per batch, whose completion callback resolves an asyncio
future.

ctypes releases the GIL around every call, so a batch issued from a worker thread runs
alongside the event loop. The struct layouts below are UCX 1.19-1.21's (checked against
`ucp.h` with offsetof).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import os
import threading
from typing import Any

from kvtransfer.errors import PeerUnavailable

_PARAM_ADDRESS, _PARAM_LENGTH, _PARAM_MEMTYPE = 1, 2, 16
_OP_CALLBACK, _OP_USER_DATA, _OP_MEMTYPE, _OP_MEMH = 2, 4, 64, 256
_MEMTYPE_HOST, _MEMTYPE_CUDA = 0, 1
_ERR_LAST = -100  # UCS_ERR_LAST: pointers in [-100, -1] encode an error status


class _MemMapParams(ctypes.Structure):
    _fields_ = [("field_mask", ctypes.c_uint64), ("address", ctypes.c_void_p),
                ("length", ctypes.c_size_t), ("flags", ctypes.c_uint),
                ("prot", ctypes.c_uint), ("memory_type", ctypes.c_int),
                ("exported_memh_buffer", ctypes.c_void_p)]


_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)


class _RequestParam(ctypes.Structure):
    _fields_ = [("op_attr_mask", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("request", ctypes.c_void_p), ("cb", _CALLBACK),
                ("datatype", ctypes.c_uint64), ("user_data", ctypes.c_void_p),
                ("reply_buffer", ctypes.c_void_p), ("memory_type", ctypes.c_int),
                ("recv_info", ctypes.c_void_p), ("memh", ctypes.c_void_p)]


assert ctypes.sizeof(_MemMapParams) == 48 and ctypes.sizeof(_RequestParam) == 72


def _load() -> ctypes.CDLL:
    import libucx
    import ucxx  # noqa: F401 - loads libucp the way ucxx does, before we look it up

    lib = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so"))
    vp, sz, st = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    for name, res, args in (
            ("ucp_mem_map", st, [vp, ctypes.POINTER(_MemMapParams), ctypes.POINTER(vp)]),
            ("ucp_mem_unmap", st, [vp, vp]),
            ("ucp_rkey_pack", st, [vp, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)]),
            ("ucp_rkey_buffer_release", None, [vp]),
            ("ucp_ep_rkey_unpack", st, [vp, vp, ctypes.POINTER(vp)]),
            ("ucp_rkey_destroy", None, [vp]),
            ("ucp_get_nbx", vp, [vp, vp, sz, ctypes.c_uint64, vp,
                                 ctypes.POINTER(_RequestParam)]),
            ("ucp_put_nbx", vp, [vp, vp, sz, ctypes.c_uint64, vp,
                                 ctypes.POINTER(_RequestParam)]),
            ("ucp_ep_flush_nbx", vp, [vp, ctypes.POINTER(_RequestParam)]),
            ("ucp_request_free", None, [vp]),
            ("ucp_worker_signal", st, [vp]),
            ("ucs_status_string", ctypes.c_char_p, [st])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


class Ucp:
    """libucp's RMA calls. One per process is enough, but it is passed explicitly."""

    def __init__(self) -> None:
        self.lib = _load()

    def error(self, status: int, what: str) -> PeerUnavailable:
        text = self.lib.ucs_status_string(status).decode()
        return PeerUnavailable(f"ucx {what} failed: {text} ({status})")

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise self.error(status, what)

    def mem_map(self, context: int, address: int, length: int, cuda: bool) -> int:
        """Register `length` bytes at `address` with a UCP context; returns the memh."""
        params = _MemMapParams(field_mask=_PARAM_ADDRESS | _PARAM_LENGTH | _PARAM_MEMTYPE,
                               address=address, length=length,
                               memory_type=_MEMTYPE_CUDA if cuda else _MEMTYPE_HOST)
        memh = ctypes.c_void_p()
        self.check(self.lib.ucp_mem_map(context, ctypes.byref(params), ctypes.byref(memh)),
                   "mem_map")
        return int(memh.value or 0)

    def mem_unmap(self, context: int, memh: int) -> None:
        self.lib.ucp_mem_unmap(context, memh)

    def rkey_pack(self, context: int, memh: int) -> bytes:
        buf, size = ctypes.c_void_p(), ctypes.c_size_t()
        self.check(self.lib.ucp_rkey_pack(context, memh, ctypes.byref(buf), ctypes.byref(size)),
                   "rkey_pack")
        try:
            return ctypes.string_at(buf, size.value)
        finally:
            self.lib.ucp_rkey_buffer_release(buf)

    def rkey_unpack(self, ep: int, packed: bytes) -> int:
        rkey = ctypes.c_void_p()
        self.check(self.lib.ucp_ep_rkey_unpack(ep, packed, ctypes.byref(rkey)), "rkey_unpack")
        return int(rkey.value or 0)

    def rkey_destroy(self, rkey: int) -> None:
        self.lib.ucp_rkey_destroy(rkey)


class Flushes:
    """Flush completions, delivered to the event loop: `new()` a future, then pass its
    id to `Getter.run`; UCX's progress thread resolves it (status 0 or an error)."""

    def __init__(self, ucp: Ucp, loop: asyncio.AbstractEventLoop) -> None:
        self._ucp = ucp
        self._loop = loop
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._lock = threading.Lock()
        self.callback = _CALLBACK(self._done)  # held: UCX keeps only the pointer

    def new(self) -> tuple[int, asyncio.Future[int]]:
        fid, fut = next(self._ids), self._loop.create_future()
        with self._lock:
            self._pending[fid] = fut
        return fid, fut

    def resolve(self, fid: int, status: int) -> None:
        """Thread-safe: complete flush `fid` with `status`."""
        with self._lock:
            fut = self._pending.pop(fid, None)
        if fut is not None:
            self._loop.call_soon_threadsafe(_set, fut, status)

    def _done(self, request: int, status: int, user_data: int) -> None:
        # UCX's progress thread, under the worker's lock; ctypes took the GIL.
        self._ucp.lib.ucp_request_free(request)
        self.resolve(int(user_data or 0), status)


def _set(fut: asyncio.Future[int], status: int) -> None:
    if not fut.done():
        fut.set_result(status)


def _status_of(ptr: int | None) -> int | None:
    """None: a request in flight; 0: done at once; < 0: an error status."""
    if ptr is None:
        return 0
    signed = ptr - (1 << 64) if ptr >= 1 << 63 else ptr
    return signed if _ERR_LAST <= signed < 0 else None


class Batch:
    """Issues one batch of puts or gets on one endpoint, then one flush. Call `run`
    from any thread (ctypes drops the GIL, so lanes run side by side)."""

    def __init__(self, ucp: Ucp, worker: int, flushes: Flushes) -> None:
        self._ucp = ucp
        self._worker = worker
        self._flushes = flushes

    def run(self, op: str, ep: int, rkey: int, parts: Any, fid: int, memh: int = 0,
            cuda: bool = False) -> None:
        """`op` ("put" or "get") each (local address, nbytes, remote address) of `parts`
        (tuples, or rows of an int64 array), flush the endpoint, and resolve flush `fid`
        once every operation has completed remotely (at once if they already have).
        Raises PeerUnavailable if UCX refuses one."""
        if hasattr(parts, "tolist"):
            parts = parts.tolist()  # Python ints for ctypes, converted on this thread
        lib = self._ucp.lib
        call = lib.ucp_put_nbx if op == "put" else lib.ucp_get_nbx
        param = ctypes.byref(_RequestParam(
            op_attr_mask=_OP_MEMTYPE | (_OP_MEMH if memh else 0),
            memory_type=_MEMTYPE_CUDA if cuda else _MEMTYPE_HOST, memh=memh or None))
        for local, nbytes, remote in parts:
            ptr = call(ep, local, nbytes, remote, rkey, param)
            status = _status_of(ptr)
            if status is None:
                lib.ucp_request_free(ptr)  # completes on its own; the flush waits for it
            elif status:
                raise self._ucp.error(status, op)
        flush = _RequestParam(op_attr_mask=_OP_CALLBACK | _OP_USER_DATA,
                              cb=self._flushes.callback, user_data=fid)
        ptr = lib.ucp_ep_flush_nbx(ep, ctypes.byref(flush))
        status = _status_of(ptr)
        if status is not None:
            self._flushes.resolve(fid, status)
        else:
            lib.ucp_worker_signal(self._worker)  # wake the (blocking) progress thread
