"""Where saved activations live between forward and backward: GPU, pinned host or NVMe.

``put`` stores a tensor on a tier and returns a handle; ``prefetch`` starts bringing it back
to the GPU (on the H2D stream) ahead of use; ``get`` returns it on the GPU, with the compute
stream ordered after the copy. Offload copies run on the D2H stream after the compute that
produced the tensor, so forward compute never waits for them.
"""

from __future__ import annotations

import errno
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from lazytrain.config import ConfigError
from lazytrain.memory.host_store import check_available
from lazytrain.memory.nvme import NvmeError, NvmeStore, aligned_empty, padded_bytes
from lazytrain.runtime.streams import Streams, StreamTrace


@dataclass(slots=True)
class Handle:
    tier: str
    tensor: torch.Tensor | None = None  # gpu: the tensor; host: the pinned copy
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    stored: torch.cuda.Event | None = None  # host copy complete
    fetched: torch.Tensor | None = None  # GPU copy being prefetched
    fetched_event: torch.cuda.Event | None = None
    consumed: bool = False  # the fetched copy was handed to compute (`get`)
    nbytes: int = 0
    written: Future | None = None  # nvme: the file write (-> NvmeRecord)
    read: Future | None = None  # nvme: the file read into read_buffer
    read_buffer: torch.Tensor | None = None


REUSE_SLACK = 1.25
"""An idle host buffer serves a tensor of at least 1/REUSE_SLACK of its size (`ActivationStore._host_buffer`)."""

FETCH_ALLOCATIONS = ("h2d", "compute")
"""Where a fetched activation's GPU memory is allocated (`ActivationStore`'s ``fetch_allocation``)."""


class ActivationStore:
    """``fetch_allocation``: the caching allocator's pool a tensor fetched back to the GPU comes
    from. ``h2d``: the copy stream's, as the copy allocates it. The caching allocator keeps one
    pool per stream, and memory cached in one is reused by the other only by freeing every cached
    block and retrying (a device synchronisation): the H200's 7B steps of 2026-12-03, whose plans
    put 34-66 GB of activations on the host tier, made two such retries a step and spent 0.63-0.98 s
    of host time in these allocations, while their GPU sat idle 0.57-0.63 s more than the
    simulator predicted. ``compute``: the compute stream's pool, the one the forward's
    activations are freed to; the copy then waits for the compute queued before the fetch (the
    memory's last users). Compute reads the copy only after waiting for it (`get`); one freed
    unread makes compute wait for it (`free`), and an abandoned step's for every queued copy
    (`abandon`), so the block's next user on compute comes after the copy (no record_stream,
    which would hold the block until the copy stream's later fetches, themselves waiting on
    compute). Host-tier fetches only: an NVMe tensor read in `get` keeps the copy stream's
    pool. The default: on the H200 (Qwen2.5-7B shape, `bench/plan_bench.py`, one run each,
    2026-12-03) it took the host's allocation time from 1.46 to 0.002 s a step at batch 158
    (63.9 GB on the host tier) and from 1.85 to 0.001 s at 2 x 32768 (32.6 GB), the retries
    from 3 to 2 and from 2 to 0; the copies waited on compute longer (exposed H2D 0.11 -> 0.26
    and 0.12 -> 0.38 s), but the GPU idled less (0.54 -> 0.26, 0.62 -> 0.27 s): steps of 17.57
    against 17.78 s and 9.44 against 9.62 s, and 6.58 against 6.59 s at batch 64 (5.2 GB)."""

    def __init__(self, streams: Streams, device: torch.device, trace: StreamTrace | None = None,
                 nvme: NvmeStore | None = None, fetch_allocation: str = "compute"):
        if fetch_allocation not in FETCH_ALLOCATIONS:
            raise ValueError(f"fetch_allocation must be one of {list(FETCH_ALLOCATIONS)}, got {fetch_allocation!r} "
                             "(the Executor's argument; bench/plan_bench.py --fetch-allocation)")
        self.fetch_allocation = fetch_allocation
        self.streams = streams
        self.trace = trace
        self.device = device
        self.nvme = nvme
        self.bytes_by_tier = {"gpu": 0, "host": 0, "nvme": 0}
        self.peak_by_tier = {"gpu": 0, "host": 0, "nvme": 0}
        self._pool_lock = threading.Lock()
        self.fetch_alloc_seconds = 0.0
        """Host time this step in the GPU allocations of fetched activations (an allocator that
        has to free cached blocks and retry blocks the host here)."""
        # pinned host buffers (`_host_buffer`), each idle one with the event after which no
        # copy reads it any more: the host tier's by slot, the NVMe tier's staging in a pool
        # (oldest first); the lent ones by address, with their slot
        self._slots: dict[object, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._idle: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._lent: dict[int, tuple[torch.Tensor, object]] = {}
        self.host_buffer_bytes = 0
        """Bytes of host buffers held, idle or lent."""
        self._lent_bytes = 0
        self._lent_high = 0

    def _account(self, tier: str, nbytes: int) -> None:
        self.bytes_by_tier[tier] += nbytes
        self.peak_by_tier[tier] = max(self.peak_by_tier[tier], self.bytes_by_tier[tier])

    def _host_buffer(self, numel: int, dtype: torch.dtype, slot: object = None
                     ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A pinned buffer of ``numel`` ``dtype`` elements, and the event after which no GPU copy
        reads it any more (None: a new one): a D2H copy into it is ordered after that on its
        stream; a CPU writer (an NVMe read) must wait for it itself.

        Buffers are kept across steps. A host-tier tensor has a ``slot`` (which saved tensor of
        which layer: the same every step of a plan) and gets its slot's buffer, replaced by a
        larger one when it does not fit: batches of varying length (padded SFT batches) then
        settle on each slot's longest, what the plan put on the host tier at its full shape,
        with no new pinning once that length has come. (Kept by exact size in one pool, the
        buffers grew with every new length until the kernel killed a 7B run on the H200
        machine, 2026-12-03.) The NVMe tier's staging buffers (no slot) come from a pool: the
        smallest idle one that holds the bytes if at most `REUSE_SLACK` times larger; before a
        new one is made, idle ones are freed, oldest first, until the buffers held are no more
        than the most ever lent at once."""
        size = padded_bytes(numel * dtype.itemsize)
        evicted: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        with self._pool_lock:
            if slot is not None and slot in self._slots:
                if self._slots[slot][0].numel() >= size:
                    base, last_read = self._slots.pop(slot)
                    return self._lend(base, slot, numel, dtype), last_read
                evicted.append(self._slots.pop(slot))  # too small for this batch: a larger one
                self.host_buffer_bytes -= evicted[-1][0].numel()
            elif slot is None:
                fits = [i for i, (buf, _) in enumerate(self._idle) if size <= buf.numel() <= size * REUSE_SLACK]
                if fits:
                    base, last_read = self._idle.pop(min(fits, key=lambda i: self._idle[i][0].numel()))
                    return self._lend(base, None, numel, dtype), last_read
                budget = max(self._lent_high, self._lent_bytes + size)
                while self._idle and self.host_buffer_bytes + size > budget:
                    evicted.append(self._idle.pop(0))
                    self.host_buffer_bytes -= evicted[-1][0].numel()
        self._free(evicted)
        # a new buffer is page-locked memory the kernel cannot reclaim: stop with a message
        # rather than be killed by the kernel when the machine has run short since planning
        check_available(size, "a host-tier activation buffer")
        # 4 KiB-aligned and padded, so the NVMe tier can write and read it with O_DIRECT
        base = aligned_empty(size, torch.uint8, pin=self.streams.cuda)
        with self._pool_lock:
            self.host_buffer_bytes += size
            return self._lend(base, slot, numel, dtype), None

    @staticmethod
    def _free(buffers: list[tuple[torch.Tensor, torch.cuda.Event | None]]) -> None:
        """Unpin and unmap ``buffers`` (taken out of the store) once no queued copy reads them."""
        for event in [event for _, event in buffers if event is not None]:
            event.synchronize()
        buffers.clear()  # the last references (no loop variable holds one)

    def _lend(self, base: torch.Tensor, slot: object, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A view of ``numel`` ``dtype`` elements of ``base``, counted as lent until `_release`
        (under the pool's lock). ``base`` owns the pinning, so it is kept while the view is out."""
        view = base[: numel * dtype.itemsize].view(dtype)
        self._lent[base.data_ptr()] = (base, slot)
        self._lent_bytes += base.numel()
        self._lent_high = max(self._lent_high, self._lent_bytes)
        return view

    def _release(self, buf: torch.Tensor, last_read: torch.cuda.Event | None) -> None:
        with self._pool_lock:
            base, slot = self._lent.pop(buf.data_ptr())
            self._lent_bytes -= base.numel()
            if slot is None:
                self._idle.append((base, last_read))
            else:
                if slot in self._slots:  # a second buffer of one slot (not seen): the pool's to reuse
                    self._idle.append(self._slots[slot])
                self._slots[slot] = (base, last_read)

    def _reclaim(self) -> None:
        """Take back the host-tier buffers an abandoned step left lent (its handles are
        garbage) to their slots, read again only after every copy queued so far. (The NVMe
        tier's staging buffers come back when their file I/O ends.)"""
        with self._pool_lock:
            left = {ptr: entry for ptr, entry in self._lent.items() if entry[1] is not None}
            for ptr in left:
                del self._lent[ptr]
        if not left:
            return
        queued = self.streams.record(self.streams.h2d)
        with self._pool_lock:
            for base, slot in left.values():
                self._lent_bytes -= base.numel()
                if slot in self._slots:
                    self._idle.append(self._slots[slot])
                self._slots[slot] = (base, queued)

    def close(self) -> None:
        """Free every host buffer (an executor given up after a failed step: its pinned memory
        goes now, not when whatever still refers to it lets go)."""
        self._reclaim()
        with self._pool_lock:
            held = [*self._slots.values(), *self._idle]
            self._slots, self._idle = {}, []
            self.host_buffer_bytes -= sum(base.numel() for base, _ in held)
        self._free(held)

    def _offload(self, tensor: torch.Tensor, slot: object = None) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Copy ``tensor`` into a pinned buffer (``slot``'s: `_host_buffer`) on the D2H stream;
        -> (buffer, copy done)."""
        src = tensor.detach().contiguous()
        buf, last_read = self._host_buffer(src.numel(), src.dtype, slot)
        self.streams.wait(last_read, self.streams.d2h)
        produced = self.streams.record()
        self.streams.wait(produced, self.streams.d2h)
        span = self.trace.begin(self.streams.d2h) if self.trace else None
        with self.streams.on(self.streams.d2h):
            buf.copy_(src.view(-1), non_blocking=True)
        if self.trace:
            self.trace.end("d2h:act", span, self.streams.d2h)
        self.streams.keep_alive(src, self.streams.d2h)
        return buf, self.streams.record(self.streams.d2h)

    def put(self, tensor: torch.Tensor, tier: str, slot: object = None) -> Handle:
        """Store ``tensor`` on ``tier``. ``slot``: which saved tensor this is (the same for the
        same tensor of every step of a plan, e.g. its layer and order): a host-tier tensor reuses
        its slot's buffer (`_host_buffer`)."""
        nbytes = tensor.numel() * tensor.element_size()
        if tier == "gpu":
            self._account("gpu", nbytes)
            return Handle(tier="gpu", tensor=tensor, nbytes=nbytes)
        if tier == "host":
            buf, stored = self._offload(tensor, slot)
            self._account("host", nbytes)
            return Handle(tier="host", tensor=buf, shape=tuple(tensor.shape), dtype=tensor.dtype,
                          stored=stored, nbytes=nbytes)
        if tier == "nvme":
            if self.nvme is None:
                raise ConfigError(
                    "the plan keeps activations on the 'nvme' tier but no NVMe folder is set; "
                    "set memory.nvme_dir=/path/on/a/fast/disk"
                )
            buf, stored = self._offload(tensor)
            written = self.nvme.write(buf, stored)
            written.add_done_callback(lambda _: self._release(buf, None))
            self._account("nvme", nbytes)
            return Handle(tier="nvme", shape=tuple(tensor.shape), dtype=tensor.dtype,
                          written=written, nbytes=nbytes)
        raise ValueError(f"activation tier {tier!r} is not one of gpu, host, nvme")

    def prefetch(self, handle: Handle) -> None:
        if handle.tier == "nvme":
            if handle.read is None:
                record = handle.written.result()
                numel = handle.nbytes // torch.empty((), dtype=handle.dtype).element_size()
                # a pooled buffer's last H2D copy may still be queued: the read waits for it
                handle.read_buffer, last_read = self._host_buffer(numel, handle.dtype)
                handle.read = self.nvme.read(record, handle.read_buffer, ready=last_read)
            return
        if handle.tier != "host" or handle.fetched is not None:
            return
        self._to_device(handle, handle.tensor, handle.stored)

    def _to_device(self, handle: Handle, buf: torch.Tensor, ready: torch.cuda.Event | None) -> None:
        self.streams.wait(ready, self.streams.h2d)
        # from the compute stream's pool, whose last users are queued there; not an NVMe read
        # fetched in `get`, whose copy would then wait for all queued compute before it starts
        on_compute = self.fetch_allocation == "compute" and handle.tier == "host"

        def allocate() -> torch.Tensor:  # on the current stream's pool, timed
            t0 = time.perf_counter()
            out = torch.empty(handle.shape, dtype=handle.dtype, device=self.device)
            self.fetch_alloc_seconds += time.perf_counter() - t0
            return out

        if on_compute:
            out = allocate()
            self.streams.wait(self.streams.record(), self.streams.h2d)
        with self.streams.on(self.streams.h2d):
            if not on_compute:
                out = allocate()
            span = self.trace.begin(self.streams.h2d) if self.trace else None
            out.view(-1).copy_(buf, non_blocking=True)
        if self.trace:
            self.trace.end("h2d:act", span, self.streams.h2d)
        handle.fetched = out
        handle.fetched_event = self.streams.record(self.streams.h2d)

    def get(self, handle: Handle) -> torch.Tensor:
        if handle.nbytes == 0 and handle.tensor is None and handle.fetched is None:
            raise RuntimeError(f"activation read after it was freed ({handle.tier} tier, shape {handle.shape}): "
                               "a saved tensor was read more times than it was saved")
        if handle.tier == "gpu":
            return handle.tensor
        self.prefetch(handle)
        if handle.tier == "nvme" and handle.fetched is None:
            self._to_device(handle, handle.read.result(), None)
        self.streams.wait(handle.fetched_event)
        handle.consumed = True
        out = handle.fetched
        self.streams.keep_alive(out, self.streams.compute)
        return out

    def free(self, handle: Handle) -> None:
        """Drop the stored copy (pinned buffers go back to the pool, files are removed)."""
        if handle.nbytes == 0:
            return
        self.bytes_by_tier[handle.tier] -= handle.nbytes
        if self.fetch_allocation == "compute" and handle.fetched is not None and not handle.consumed:
            self.streams.wait(handle.fetched_event)  # the compute pool's next user after the copy
        if handle.tier == "host":
            self._release(handle.tensor, handle.fetched_event)
        elif handle.tier == "nvme":
            if handle.read is not None:
                handle.read.result()
                self._release(handle.read_buffer, handle.fetched_event)
            self.nvme.remove(handle.written.result())
        handle.tensor = handle.fetched = handle.read_buffer = None
        handle.nbytes = 0

    def abandon(self) -> None:
        """A step stopped by an error: compute waits for every copy queued on the copy stream
        (with ``fetch_allocation=compute`` a dropped fetch's block goes back to the compute
        stream's pool, whose next user must come after the copy into it)."""
        if self.fetch_allocation == "compute":
            self.streams.wait(self.streams.record(self.streams.h2d))

    def reset_peaks(self) -> None:
        self.peak_by_tier = dict(self.bytes_by_tier)

    def start_step(self, nvme_bytes: int = 0) -> None:
        """Nothing is stored between steps (an abandoned step's handles are garbage).

        With an NVMe tier, checks before anything is written that the folder has room for
        ``nvme_bytes`` (what the plan puts there, as far as the caller knows it) and for the
        NVMe peak of the last step.
        """
        need = max(nvme_bytes, self.peak_by_tier["nvme"])
        if self.nvme is not None and need > 0:
            free = self.nvme.free_bytes()
            if free < need:
                raise NvmeError(
                    errno.ENOSPC,
                    f"NVMe folder full: this step needs {need / 2**30:.2f} GiB for activations, "
                    f"{free / 2**30:.2f} GiB free; free space there, point memory.nvme_dir at a "
                    "larger disk, or plan with less on the NVMe tier",
                    str(self.nvme.folder),
                )
        self._reclaim()
        self.bytes_by_tier = {tier: 0 for tier in self.bytes_by_tier}
        self.fetch_alloc_seconds = 0.0
        self.reset_peaks()
