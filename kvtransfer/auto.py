"""`auto`: per sender, the fastest path the two caches allow, over one receiver.

`cuda_ipc` and `ucx` speak the same in-place protocol (a revocable grant, a batched copy,
WRITTEN notices) and differ only in how the bytes move, so one receiver can offer
both: its WELCOME carries the exported cache (CUDA IPC handle and the GPU's UUID, or
pid/address for a host cache) and the UCX remote key. Each sender picks at connect:
when it can map the cache (`cuda_ipc.ipc_refusal`: the receiver's node, same boot id;
the same memory kind; on CUDA, the receiver's GPU visible here and the same GPU or a
P2P peer of its own) it copies with one batched launch per chunk (`cuda_ipc`, over
NVLink / PCIe between GPUs); otherwise it puts over UCX (RDMA where the fabric has it).
Fencing, leases and metrics are the receiver's, whichever path a sender takes.

Workers use it for `--transport auto` with CUDA caches (worker/cli.py).
"""

from __future__ import annotations

from typing import Any

from kvtransfer.cuda_ipc import CudaIpcReceiver, CudaIpcSender, local_refusal
from kvtransfer.layout import Pairs
from kvtransfer.memory import Ready
from kvtransfer.sender import Peer
from kvtransfer.ucx import UcxReceiver, UcxSender


class AutoReceiver(CudaIpcReceiver, UcxReceiver):
    name = "auto"


class AutoSender(CudaIpcSender, UcxSender):
    name = "auto"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paths: dict[int, str] = {}  # id(peer) -> "cuda_ipc" | "ucx"

    def _open(self) -> None:
        """Nothing before a connection: ucx lanes only for a peer off this node."""

    async def _on_connected(self, peer: Peer) -> None:
        assert self.kv is not None
        local = local_refusal(peer.welcome, self.kv) is None
        self.paths[id(peer)] = "cuda_ipc" if local else "ucx"
        if local:
            await CudaIpcSender._on_connected(self, peer)
        else:
            await UcxSender._on_connected(self, peer)

    async def _copy(self, peer: Peer, pairs: Pairs,
                    deadline: float, ready: Ready | None) -> Ready | None:
        if self.paths.get(id(peer)) == "cuda_ipc":
            return await CudaIpcSender._copy(self, peer, pairs, deadline, ready)
        return await UcxSender._copy(self, peer, pairs, deadline, ready)

    async def _on_disconnected(self, peer: Peer) -> None:
        if self.paths.pop(id(peer), None) == "cuda_ipc":
            await CudaIpcSender._on_disconnected(self, peer)
        else:
            await UcxSender._on_disconnected(self, peer)


__all__ = ["AutoReceiver", "AutoSender"]
