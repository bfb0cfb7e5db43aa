"""Point-to-point between pipeline ranks, with the activation shape and dtype known up front.

Every tensor crossing a stage boundary has the same shape: the activation (micro-batch, seq, d_model)
going forward and its gradient going back (tensor parallelism with sequence parallelism makes it
(micro-batch, seq / tp, d_model) per rank, hence a constructor argument). Knowing it up front means
no shape handshake: a receive allocates its buffer and posts one recv.

All traffic goes through `mini3d.comm.send/recv` on the pp Axis, so each transfer is logged with
the runtime's context (step, action, micro-batch). Receives block; the runtime posts sends without
blocking by default (`send(async_op=True)`, kept alive by `SendQueue`) and waits for them before
the step ends. Deadlock freedom comes from the order of the calls, not from batching: the Schedule
lists sends and receives so that `check()` proves them safe under blocking rendezvous semantics
(gloo's behaviour: its blocking send waits for the matching receive even for a few KiB), and so
that any two neighbours' transfers toward each other pair up one for one in issue order (rank a's
k-th is a send iff rank b's k-th is the matching receive), which NCCL's rules need as well: NCCL runs
a pair's ops in issue order on one stream and a send may wait for its receive. Every launched run
checks that pairing under MINI3D_CHECK_P2P=1 (`mini3d.launch.p2p_record`). For the one pattern
where two neighbours must each send to the other at the same step, `exchange` fixes the order: the
lower pp index sends first and then receives, the higher one receives first and then sends (ring
attention, where every rank sends and receives at once, batches instead: `comm.batch_p2p`).
"""

from __future__ import annotations

import torch

from mini3d import comm


class PipeP2P:
    """Logged transfers of fixed-shape tensors between pipeline ranks (a receive blocks; a send
    blocks unless `async_op`).

    `axis` is the pp Axis of this rank (`topo.pp`); peers are given as pp indices (0 .. p-1)."""

    def __init__(self, axis, shape, dtype=torch.float32, device=None):
        self.axis = axis
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def _check(self, tensor: torch.Tensor):
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise ValueError(f"pipeline transfer of shape {tuple(tensor.shape)} {tensor.dtype}, "
                             f"but this pipeline was built for {self.shape} {self.dtype} (pass "
                             f"the per-rank boundary shape to the runtime)")

    def send(self, tensor: torch.Tensor, peer_index: int, async_op: bool = False):
        """Send `tensor` (detached, contiguous) to pipeline rank `peer_index`. With `async_op` it
        returns a work handle; the caller keeps `tensor` alive until `wait()` (see `SendQueue`)."""
        self._check(tensor)
        return comm.send(tensor.detach().contiguous(), self.axis, self.axis.ranks[peer_index],
                         async_op=async_op, dtype=self.dtype)

    def recv(self, peer_index: int) -> torch.Tensor:
        """Receive one boundary tensor from pipeline rank `peer_index` into a new buffer."""
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        comm.recv(buf, self.axis, self.axis.ranks[peer_index], dtype=self.dtype)
        return buf

    def irecv(self, peer_index: int):
        """Post a receive of one boundary tensor from `peer_index`: (buffer, work); read the buffer
        only after `work.wait()`."""
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return buf, comm.recv(buf, self.axis, self.axis.ranks[peer_index], async_op=True)

    def exchange(self, tensor: torch.Tensor, peer_index: int) -> torch.Tensor:
        """Send `tensor` to `peer_index` and receive one from it, in the order that cannot hang:
        the lower pp index sends then receives; the higher receives then sends."""
        if self.axis.index < peer_index:
            self.send(tensor, peer_index)
            return self.recv(peer_index)
        got = self.recv(peer_index)
        self.send(tensor, peer_index)
        return got


class SendQueue:
    """Sends in flight. A non-blocking send lets the sender go on computing while the receiver is
    still busy (on gloo a blocking send waits for the matching receive, at any size, which
    would make a rank idle while its neighbour computes). Order is kept: sends to one peer
    complete in issue order. A schedule that `check()` proves safe with blocking sends stays safe
    with non-blocking ones under gloo's rules, since a rank can only block on fewer operations;
    under NCCL's, as long as each pair's transfers pair up one for one (see the module docstring)."""

    def __init__(self):
        self.pending = []  # (work, tensor kept alive until the send completes)

    def add(self, work, tensor):
        self.pending.append((work, tensor))
        self.reap()

    def reap(self):
        """Retire finished sends (records their end in the log); keep the rest."""
        keep = []
        for work, tensor in self.pending:
            if work.is_completed():
                work.wait()
            else:
                keep.append((work, tensor))
        self.pending = keep

    def wait_all(self):
        for work, _ in self.pending:
            work.wait()
        self.pending = []


__all__ = ["PipeP2P", "SendQueue"]
