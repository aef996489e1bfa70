"""Measure a `CostTable` from the executor's own pieces on this machine.

Times are medians over repeats after warm-up, with CUDA events on a GPU (perf_counter on the
CPU). Per layer: the no-grad forward (what a segment rebuild runs), the forward under autograd
(a recompute), its backward, the bytes autograd saves (counted through saved_tensors_hooks,
storages de-duplicated, weights and step constants left out, the lean norms' outputs counted as
the executor keeps them: as their inputs) and the working sets from the allocator's peaks; and,
at the reference shape, the saved bytes, backward time and working set of the layer kept with
each thing it may recompute in backward (`sublayer.options`: its MLP, its attention block, its
MLP's up projection; ``LayerCosts.recompute_options``). A stack of several layer types
(Qwen3.5's linear and full attention) has each type measured on its first layer. Constants: the embedding and the chunked head + loss. Machine: H2D, D2H
and both-directions bandwidth at one layer's transfer size, the slowdown of compute while a
copy runs, the CPU optimizer's time per parameter, and (given an `NvmeStore`) the disk's
write and read bandwidth through the NVMe tier's own path (pinned buffer, thread pool, CRC) at
one checkpoint's size. Times are measured at several batch shapes and fitted (`ShapeFit`), so
`CostTable.at` can rescale without profiling again.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Self

import torch
from torch.autograd.graph import saved_tensors_hooks

from lazytrain.memory.host_store import HostStore, activation_room, host_memory_total
from lazytrain.memory.nvme import NvmeStore, aligned_empty
from lazytrain.model import sublayer
from lazytrain.model.adapter import ModelAdapter, mask_tensors
from lazytrain.model.lean import Recipe, Recomputed, recomputed_read, saved_recipe
from lazytrain.optim.base import HostOptimizer
from lazytrain.optim.factory import describe
from lazytrain.optim.master import MASTER_BYTES, Master, master_mode, new_master
from lazytrain.optim.quant import BLOCK
from lazytrain.plan.costs import (
    CostTable,
    LayerCosts,
    RecomputeCosts,
    ShapeFit,
    default_fits,
    usable_gpu_bytes,
)
from lazytrain.plan.plan import keep_all_plan
from lazytrain.runtime.device import time_ms
from lazytrain.runtime.executor import Executor

NVME_STAGING_BUFFERS = 4
"""Pinned checkpoint-sized buffers the NVMe tier holds at once (writes behind, reads ahead)."""


class _Peak:
    """Peak allocated bytes above the level at entry (CUDA only; 0 on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bytes = 0

    def __enter__(self) -> Self:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base


def saved_tensor_bytes(fn: Callable[[], object], excluded: tuple[torch.Tensor, ...] = (),
                       seen: set[int] | None = None) -> tuple[object, int]:
    """``fn()`` under autograd, and the bytes of the distinct storages autograd saved for its
    backward, not counting those of ``excluded`` tensors (the weight slot, rotary tables).
    ``seen``, when given, receives the saved storages' data pointers.

    Each storage is held until ``fn`` returns, as the executor's pack hook holds what it
    stores during a layer's forward: a tensor saved by a node that autograd frees before the
    forward ends (a branch the output does not depend on) would otherwise free its address for
    a later saved tensor, and the two would count once. That made this count, and a test
    comparing it with the executor's, depend on where the allocator put things (12,288 bytes
    short in about one run in six on a tiny Qwen3.5 stack)."""
    skip = {t.untyped_storage().data_ptr() for t in excluded}
    saved: dict[int, int] = {}
    held: list[torch.UntypedStorage] = []
    recomputed: dict[Recipe, Recomputed] = {}

    def pack(t: torch.Tensor):
        recipe = saved_recipe(t)
        if recipe is not None:  # a lean norm's output: its inputs are what is kept, as in the executor
            return recomputed_read(recipe, recomputed, pack), tuple(t.size()), tuple(t.stride()), t.storage_offset()
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip and ptr not in saved:
            saved[ptr] = storage.nbytes()
            held.append(storage)
        return t

    def unpack(packed):
        if isinstance(packed, tuple):
            state, size, stride, offset = packed
            return state.read(unpack).as_strided(size, stride, offset)
        return packed

    with torch.enable_grad(), saved_tensors_hooks(pack, unpack):
        result = fn()
    recomputed.clear()
    # Every saved variable of the graph refers to ``pack`` and so to this list: kept, it would
    # hold each storage to the end of the backward instead of its last use, as in the executor
    # (the H200's 9B tables of 2026-12-02 measured the backward's working set 2.5-3.5 GB larger
    # at b64 than those of 12-01, and the simulator over-predicted every backward stage by that,
    # scaled with the tokens)
    held.clear()
    if seen is not None:
        seen.update(saved)
    return result, sum(saved.values())


PACKED_DOCUMENT_TOKENS = 256
"""Tokens per document of the profiler's packed rows (about a MetaMathQA sample; a row shorter
than two holds one): sdpa's dense-mask kernels cost the same wherever the boundaries fall, the
linear-attention kernels see as many segments as real rows of such samples would give them."""


def profile_batch_masks(adapter: ModelAdapter, batch: int, seq: int, attention: str):
    """(layer masks, position ids) of the profiler's batches: unmasked rows (``causal``), or
    rows of documents of about `PACKED_DOCUMENT_TOKENS` tokens, positions restarting per document
    (``packed``, or ``packed_varlen`` on the adapter's varlen path), as the executor builds them
    for packed batches."""
    if attention == "causal":
        return adapter.layer_masks(None), torch.arange(seq).unsqueeze(0).expand(batch, -1)
    if attention not in ("packed", "packed_varlen"):  # the adapter's own kernel for packed rows
        raise ValueError(f"attention must be causal, packed or packed_varlen, got {attention!r}")
    runs = "packed_varlen" if adapter.packed_attention == "varlen" else "packed"
    if attention != runs:
        raise ValueError(f"profiling {attention} attention, but this adapter runs packed rows as {runs}")
    documents = max(1, round(seq / PACKED_DOCUMENT_TOKENS))
    length = -(-seq // documents)
    document = torch.arange(seq) // length
    document_ids = (document + 1).unsqueeze(0).expand(batch, -1).contiguous()
    positions = (torch.arange(seq) - document * length).unsqueeze(0).expand(batch, -1)
    return adapter.layer_masks(None, document_ids=document_ids), positions


def _layer_inputs(executor: Executor, batch: int, seq: int, attention: str) -> tuple:
    """A random layer input of ``(batch, seq)`` and the step's constants for it: (x, rope, masks)."""
    adapter, device, dtype = executor.adapter, executor.device, executor.dtype
    masks, position_ids = profile_batch_masks(adapter, batch, seq, attention)
    rope = adapter.rotary_embeddings(position_ids.to(device), dtype)
    return torch.randn(batch, seq, adapter.hidden_size, device=device, dtype=dtype), rope, masks


def _kept_forward(adapter: ModelAdapter, layer: int, slot: torch.Tensor, x: torch.Tensor, rope, masks,
                  recompute: str = "none") -> tuple:
    """``layer``'s forward under autograd (a kept layer's), weights in ``slot``: (output, its
    input leaf, its weight leaves)."""
    leaves = adapter.layouts[layer + 1].leaves(slot)
    x_in = x.detach().requires_grad_()
    with torch.enable_grad():
        return adapter.layer_forward(layer, leaves, x_in, rope, masks, recompute=recompute), x_in, leaves


def _kept_backward(out: torch.Tensor, x_in: torch.Tensor, leaves: dict) -> None:
    """The backward of `_kept_forward`'s output, to its input and weights."""
    torch.autograd.grad(out, [x_in, *leaves.values()], torch.ones_like(out))


def _layer_forward_backward(executor: Executor, layer: int, slot: torch.Tensor, batch: int, seq: int,
                            attention: str) -> Callable[[], None]:
    """A call running ``layer``'s forward under autograd and its backward at ``(batch, seq)``,
    weights in ``slot`` (what a kept layer costs the GPU in a step)."""
    x, rope, masks = _layer_inputs(executor, batch, seq, attention)
    return lambda: _kept_backward(*_kept_forward(executor.adapter, layer, slot, x, rope, masks))


def _layer_shape_costs(executor: Executor, layer: int, slot: torch.Tensor, batch: int, seq: int,
                       repeats: int, options: bool = False, attention: str = "causal") -> dict:
    """One layer's costs at one batch shape with ``attention`` (`profile_batch_masks`); with
    ``options``, also those of the layer kept with each block recomputed in its backward
    (``recompute_options``)."""
    adapter, device = executor.adapter, executor.device
    layout = adapter.layouts[layer + 1]
    x, rope, masks = _layer_inputs(executor, batch, seq, attention)
    excluded = (slot, *rope, *mask_tensors(masks))  # per-step constants in the executor

    def forward_no_grad():
        with torch.no_grad():
            return adapter.layer_forward(layer, layout.views(slot), x, rope, masks)

    def forward_grad(recompute: str = "none"):
        return _kept_forward(adapter, layer, slot, x, rope, masks, recompute)

    state = {}

    def run_forward_grad():
        state["out"] = forward_grad()

    def run_backward():
        _kept_backward(*state["out"])

    def backward_costs(recompute: str = "none") -> tuple[float, int, int, int | None]:
        """(backward ms, saved bytes, backward working set, forward working set) of the layer
        kept with ``recompute``."""
        times = []
        for _ in range(repeats + 2):
            # under the byte count's pack hook, as the executor's keep layers run: a lean norm's
            # output is recomputed in the backward timed here (two norm passes a layer)
            state["out"], _ = saved_tensor_bytes(lambda: forward_grad(recompute), excluded)
            times.append(time_ms(device, run_backward, 1, warmup=0))
        state.pop("out")  # its output would stay allocated under the next forward's window
        seen: set[int] = set()
        with _Peak(device) as fwd:
            state["out"], saved = saved_tensor_bytes(lambda: forward_grad(recompute), excluded, seen)
        # the window's peak holds the saved tensors the forward allocated (all but the input,
        # allocated before the window, when it is among them) and the transient on top: the
        # kept forward's working set
        allocated = saved - (input_bytes if x.untyped_storage().data_ptr() in seen else 0)
        # measured on CUDA only (`_Peak`): elsewhere None, and the no-grad figure stands in
        forward_work = max(fwd.bytes - allocated, 0) if device.type == "cuda" else None
        out = state["out"][0]
        with _Peak(device) as peak:
            run_backward()
        # the output the backward starts from is live through it (the executor holds it until
        # the layer's backward is done) but was allocated before the peak's base, and it is no
        # saved tensor (a decoder layer ends in a residual add, which saves nothing)
        return (statistics.median(times[2:]), max(saved, input_bytes), peak.bytes + out.untyped_storage().nbytes(),
                forward_work)

    input_bytes = x.numel() * x.element_size()
    forward_ms = time_ms(device, forward_no_grad, repeats)
    recompute_ms = time_ms(device, run_forward_grad, repeats)
    with _Peak(device) as fwd_peak:
        forward_no_grad()
    backward_ms, saved_bytes, backward_work_bytes, keep_forward_work_bytes = backward_costs()
    recompute_options = {}
    for name in sublayer.options(adapter.templates[adapter.layer_types[layer]]) if options else ():
        option_ms, option_saved, option_work, option_forward_work = backward_costs(name)
        recompute_options[name] = RecomputeCosts(
            saved_bytes=option_saved,
            # the block's re-forward: what the backward takes beyond the whole-layer keep's
            recompute_ms=max(option_ms - backward_ms, 0.0),
            backward_work_bytes=option_work,
            forward_work_bytes=option_forward_work,
        )
    return {
        "forward_ms": forward_ms,
        "recompute_ms": recompute_ms,
        "backward_ms": backward_ms,
        "input_bytes": input_bytes,
        "saved_bytes": saved_bytes,
        "forward_work_bytes": fwd_peak.bytes,
        "keep_forward_work_bytes": keep_forward_work_bytes,
        "backward_work_bytes": backward_work_bytes,
        "recompute_options": recompute_options,
    }


def _bandwidths(host: torch.Tensor, device: torch.device, repeats: int,
                together: Callable[[], None] = lambda: None, layer: Callable[[], object] | None = None) -> dict:
    """GB/s of H2D, D2H and each direction when both run, at one layer's size (pinned both
    ways, as the executor copies), and how much slower compute runs while a copy is in flight.

    ``together`` (data parallel: a barrier of the ranks) runs before each measurement, so the
    ranks of a host copy at once and each one measures its share of the host's bandwidth.

    The slowdown (``copy_slowdown``) is ``layer``'s (a decoder layer's forward and backward at
    the run's shape) under copies both ways against alone, where given; the slowdown of
    8192^3 bf16 matmuls under H2D copies (``copy_slowdown_matmuls``; the table's figure until
    2026-12-05) overstated it: 1.099 on the H200, where the runs' GPU compute at 7B implied
    ~1.03 (bench/results/plan_qwen2.5-7b_h200_notes.md).
    """
    nbytes = host.numel() * host.element_size()
    if device.type != "cuda":
        dst = torch.empty_like(host)
        ms = time_ms(device, lambda: dst.copy_(host), repeats)
        gbps = nbytes / ms / 1e6
        return {"h2d_gbps": gbps, "d2h_gbps": gbps, "bidir_gbps": gbps / 2, "copy_slowdown": 1.0}
    gpu = torch.empty(host.numel(), dtype=host.dtype, device=device)
    gpu2 = torch.empty_like(gpu)
    # the D2H target is a buffer of the activation store's own kind (`aligned_empty`, pinned in
    # place), so the table has the speed offloaded activations see: torch.empty_like(host)
    # would be pageable (a third of the speed), and torch's pinned allocator (cudaHostAlloc) is
    # not what the executor copies into
    back = aligned_empty(host.numel(), host.dtype, pin=True)
    h2d_stream, d2h_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
    compute = torch.cuda.current_stream(device)

    def h2d():
        gpu.copy_(host, non_blocking=True)

    def d2h():
        back.copy_(gpu, non_blocking=True)

    def both():
        _queue_copies(compute, (h2d_stream, 1, gpu, host), (d2h_stream, 1, back, gpu2))
        compute.wait_stream(h2d_stream)
        compute.wait_stream(d2h_stream)

    together()
    h2d_ms = time_ms(device, h2d, repeats)
    together()
    d2h_ms = time_ms(device, d2h, repeats)
    together()
    both_ms = time_ms(device, both, repeats)

    # compute alone, then the same compute while H2D copies keep the link busy throughout;
    # events on the compute stream time the matmuls only
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def matmuls():
        for _ in range(8):
            a @ a

    alone = time_ms(device, matmuls, repeats)
    copies = 2 + int(alone / h2d_ms)

    def matmuls_under_copies():
        _queue_copies(compute, (h2d_stream, copies, gpu, host))
        matmuls()

    under_copies = time_ms(device, matmuls_under_copies, repeats)
    torch.cuda.synchronize(device)
    slowdown = {"copy_slowdown_matmuls": max(1.0, under_copies / alone)}
    if layer is not None:
        slowdown["copy_slowdown_layer"] = _slowdown_under_copies(device, layer, repeats, gpu, host, back, gpu2,
                                                                 h2d_ms, d2h_ms)
    h2d_gbps, d2h_gbps = nbytes / h2d_ms / 1e6, nbytes / d2h_ms / 1e6
    serial = h2d_gbps * d2h_gbps / (h2d_gbps + d2h_gbps)
    bidir = min(max(nbytes / both_ms / 1e6, serial), min(h2d_gbps, d2h_gbps))
    return {"h2d_gbps": h2d_gbps, "d2h_gbps": d2h_gbps, "bidir_gbps": bidir,
            "copy_slowdown": slowdown.get("copy_slowdown_layer", slowdown["copy_slowdown_matmuls"]), **slowdown}


def _queue_copies(after: torch.cuda.Stream, *copies: tuple[torch.cuda.Stream, int, torch.Tensor, torch.Tensor]) -> None:
    """Per ``(stream, n, dst, src)``: ``n`` copies ``src`` -> ``dst`` (non-blocking) queued on
    ``stream`` after what ``after`` has queued so far."""
    for stream, n, dst, src in copies:
        stream.wait_stream(after)
        with torch.cuda.stream(stream):
            for _ in range(n):
                dst.copy_(src, non_blocking=True)


def _slowdown_under_copies(device: torch.device, compute: Callable[[], object], repeats: int,
                           gpu: torch.Tensor, host: torch.Tensor, back: torch.Tensor, gpu2: torch.Tensor,
                           h2d_ms: float, d2h_ms: float) -> float:
    """How much slower ``compute`` runs on the current stream while copies keep both directions
    of the link busy throughout (``host`` -> ``gpu`` and ``gpu2`` -> ``back``, pinned), against
    alone: >= 1. Events on the compute stream time the compute only. (Known, left as measured on
    the H200 on 2026-12-05: the start event is recorded before the copies are queued, so their
    launches, ~80 at 7B, are inside the timed span, and twice the compute's worth of copies is
    queued per repeat, a backlog drained only at the end.)"""
    stream = torch.cuda.current_stream(device)
    h2d_stream, d2h_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
    alone = time_ms(device, compute, repeats)
    # both ways at once each runs slower than alone: enough copies to outlast the compute
    copies_in, copies_out = 2 + int(2 * alone / h2d_ms), 2 + int(2 * alone / d2h_ms)

    def under_copies():
        _queue_copies(stream, (h2d_stream, copies_in, gpu, host), (d2h_stream, copies_out, back, gpu2))
        compute()

    under = time_ms(device, under_copies, repeats)
    torch.cuda.synchronize(device)
    return max(1.0, under / alone)


def _scratch_layer_group(optimizer_factory: Callable[[list[torch.Tensor], list[int]], HostOptimizer],
                         store: HostStore, adapter: ModelAdapter) -> tuple[HostOptimizer, Master]:
    """A scratch optimizer of the run's kind over a copy of the first layer's group (the real
    state is untouched; a whole group, whatever part of it this rank's masters hold), and that
    master (of the run's form: a split or bf16 master times its own path)."""
    master = new_master(master_mode(store.masters[1]), store.weights[1].float())
    return optimizer_factory([master], [adapter.layouts[1].decay_numel]), master


def _optimizer_ns_per_param(optimizer_factory: Callable[[list[torch.Tensor], list[int]], HostOptimizer],
                            store: HostStore, adapter: ModelAdapter, repeats: int) -> tuple[float, str]:
    """One layer group stepped on the CPU: (ns per parameter, what was timed: `describe`)."""
    scratch, master = _scratch_layer_group(optimizer_factory, store, adapter)
    grad = torch.randn(master.numel()).to(store.dtype)
    out = torch.empty(master.numel(), dtype=store.dtype) if isinstance(master, torch.Tensor) else master.weight
    ms = time_ms(torch.device("cpu"), lambda: scratch.step_group(0, grad, 0.5, 1e-5, out), repeats)
    return ms * 1e6 / master.numel(), describe(scratch)


def const_update_costs(optimizer_factory: Callable[[list[torch.Tensor], list[int]], HostOptimizer],
                       store: HostStore, adapter: ModelAdapter, device: torch.device,
                       repeats: int) -> tuple[float | None, int, int, int | None]:
    """The resident groups' optimizer step on ``device`` (`Plan.const_update="device"`): (ms for
    the embedding and final group together, GPU bytes their masters and states take there, GPU
    bytes the step allocates while it runs: `CostTable.device_step_work_bytes`, on CUDA only,
    the elements per piece it was stepped in: `CostTable.device_step_chunk`), timed on a
    scratch group the size of a decoder layer (the step is elementwise: its time is linear in
    the elements) with states of the embedding's kind; (None, 0, 0, None) where the optimizer
    has no device step."""
    scratch, master = _scratch_layer_group(optimizer_factory, store, adapter)
    if not scratch.device_step:
        return None, 0, 0, None
    scratch.to_device(0, store.weights[1].to(device, copy=True))
    grad = torch.randn(master.numel(), device=device).to(store.dtype)

    def step():
        scratch.step_group(0, grad, 0.5, 1e-5, None)

    ms = time_ms(device, step, repeats)
    held = scratch.state_bytes() + master.numel() * MASTER_BYTES[master_mode(master)]
    scale = (adapter.layouts[0].numel + adapter.final_layout.numel) / master.numel()
    work = _device_step_work_bytes(optimizer_factory, store, adapter, device)
    return ms * scale, round(held * scale), work, scratch.device_step_chunk


def _device_step_work_bytes(optimizer_factory: Callable[[list[torch.Tensor], list[int]], HostOptimizer],
                            store: HostStore, adapter: ModelAdapter, device: torch.device) -> int:
    """GPU bytes a decoder layer's optimizer step on ``device`` allocates while it runs, above
    what it holds (`CostTable.device_step_work_bytes`): the allocator's peak on one warm step
    of a scratch copy of the first layer's group, the middle of three (the first and last
    groups may keep fp32 states, ``optimizer.fp32_embedding_states``; a layer's are 8-bit). 0
    off CUDA."""
    if device.type != "cuda":  # (_Peak measures nothing there either; skip building the scratch)
        return 0
    mode = master_mode(store.masters[1])
    layer = new_master(mode, store.weights[1].float())
    ends = [new_master(mode, torch.zeros(BLOCK)) for _ in range(2)]
    scratch = optimizer_factory([ends[0], layer, ends[1]], [0, adapter.layouts[1].decay_numel, 0])
    scratch.to_device(1, store.weights[1].to(device, copy=True))
    grad = torch.randn(layer.numel(), device=device).to(store.dtype)
    scratch.step_group(1, grad, 0.5, 1e-5, None)  # compiled and warm
    with _Peak(device) as peak:
        scratch.step_group(1, grad, 0.5, 1e-5, None)
    return peak.bytes


def _nvme_bandwidths(nvme: NvmeStore, nbytes: int, files: int = 4) -> dict:
    """GB/s of writing then reading ``files`` files of ``nbytes`` each through ``nvme``.

    The same calls the activation tier makes: one file per checkpoint from an aligned pinned
    buffer, issued together on the store's pool, CRC on both sides, O_DIRECT where the
    filesystem takes it (else buffered, and then a write that fits the page cache is faster
    than the disk: what the executor would see at that size).
    """
    bufs = [aligned_empty(nbytes, torch.uint8, pin=torch.cuda.is_available()) for _ in range(files)]
    for b in bufs:
        b.fill_(7)
    t0 = time.perf_counter()
    records = [f.result() for f in [nvme.write(b) for b in bufs]]
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for f in [nvme.read(r, b) for r, b in zip(records, bufs)]:
        f.result()
    read_s = time.perf_counter() - t0
    for r in records:
        nvme.remove(r)
    total = nbytes * files
    return {"nvme_write_gbps": total / write_s / 1e9, "nvme_read_gbps": total / read_s / 1e9,
            "nvme_bytes": int(nvme.free_bytes() * 0.9)}


def profile(
    adapter: ModelAdapter,
    store: HostStore,
    device: torch.device,
    batch_size: int,
    seq_len: int,
    optimizer_factory: Callable[[list[torch.Tensor], list[int]], HostOptimizer],
    *,
    gpu_bytes: int | None = None,
    optimizer_state_bytes: int = 0,
    head_chunk_tokens: int = 4096,
    repeats: int = 5,
    nvme: NvmeStore | None = None,
    host_limit_bytes: int | None = None,
    local_world_size: int = 1,
    barrier: Callable[[], None] = lambda: None,
    attention: str = "causal",
) -> CostTable:
    """A `CostTable` for this model on this machine at ``(batch_size, seq_len)``.

    Without ``nvme`` the table has no NVMe capacity (``nvme_bytes=0``), so no plan uses that tier.
    The table's host capacity is this rank's `activation_room` (its share of
    ``host_limit_bytes`` less its model and optimizer state, bounded by the memory available
    now) less, with an NVMe tier, its pinned staging buffers. Data parallel:
    every rank profiles, ``barrier`` lines the ranks up so the host's ``local_world_size`` ranks
    copy at once (the table's bandwidths are then one rank's share), and the optimizer is timed
    on this rank's share of the cores. ``attention``: the layers are timed with the mask the
    run's batches take (`profile_batch_masks`: ``packed`` for `data.packing`).
    """
    executor = Executor(adapter, store, keep_all_plan(adapter.num_layers, batch_size, seq_len, head_chunk_tokens),
                        device)
    try:
        shapes = [(batch_size, seq_len), (max(1, batch_size // 2), seq_len), (batch_size, max(8, seq_len // 2))]
        shapes = list(dict.fromkeys(shapes))
        # one representative (the first layer) per layer type; the shape fits are the summed
        # layer types' (one fit serves the whole table)
        first = {kind: adapter.layer_types.index(kind) for kind in adapter.layer_type_names()}
        measured: dict[str, dict] = {}
        for kind, layer in first.items():
            slot = store.weights[layer + 1].to(device)
            measured[kind] = {
                shape: _layer_shape_costs(executor, layer, slot, *shape, repeats, options=shape == shapes[0],
                                          attention=attention)
                for shape in shapes
            }
            del slot
        ref = {kind: m[(batch_size, seq_len)] for kind, m in measured.items()}
        fits = default_fits()
        if len(shapes) >= 3:
            for name in ("forward_ms", "backward_ms", "recompute_ms"):
                fits[name] = ShapeFit.fit(
                    [(b, s, sum(m[(b, s)][name] for m in measured.values())) for b, s in shapes]
                )

        constants = measure_constants(executor, store, device, batch_size, seq_len, repeats)
        optimizer_ns, optimizer = _optimizer_ns_per_param(optimizer_factory, store, adapter, repeats)
        # data parallel steps each rank's shard of them on the host (`Executor`)
        const_update_ms, const_update_bytes, device_step_work_bytes, device_step_chunk = (
            const_update_costs(optimizer_factory, store, adapter, device, repeats) if local_world_size == 1
            else (None, 0, 0, None))
        esize = store.weights[1].element_size()
        type_costs = {
            kind: LayerCosts(
                params=adapter.layouts[layer + 1].numel,
                weight_bytes=adapter.layouts[layer + 1].numel * esize,
                forward_ms=ref[kind]["forward_ms"],
                backward_ms=ref[kind]["backward_ms"],
                recompute_ms=ref[kind]["recompute_ms"],
                input_bytes=ref[kind]["input_bytes"],
                saved_bytes=ref[kind]["saved_bytes"],
                forward_work_bytes=ref[kind]["forward_work_bytes"],
                keep_forward_work_bytes=ref[kind]["keep_forward_work_bytes"],
                backward_work_bytes=ref[kind]["backward_work_bytes"],
                recompute_options=ref[kind]["recompute_options"],
            )
            for kind, layer in first.items()
        }
        input_bytes = max(r["input_bytes"] for r in ref.values())
        const_params = adapter.layouts[0].numel + adapter.final_layout.numel
        if device.type == "cuda":
            total_gpu = torch.cuda.get_device_properties(device).total_memory
        else:
            total_gpu = host_memory_total() // 4
        # the slowdown under copies of the first layer's forward and backward at the run's shape
        slot = store.weights[1].to(device)
        machine = _bandwidths(store.weights[1], device, repeats, barrier,
                              layer=_layer_forward_backward(executor, 0, slot, batch_size, seq_len, attention))
        del slot
        slowdowns = {k: machine.pop(k) for k in ("copy_slowdown_matmuls", "copy_slowdown_layer") if k in machine}
        # with an NVMe tier, its write-behind and read-ahead buffers (pinned, pooled)
        staging = NVME_STAGING_BUFFERS * input_bytes if nvme is not None else 0
        host_free = activation_room(store.bytes(optimizer_state_bytes).total, host_limit_bytes, local_world_size,
                                    staging)
        if nvme is not None:
            disk = _nvme_bandwidths(nvme, input_bytes)
            disk_note = (f"NVMe bandwidth measured in {nvme.folder} at {input_bytes} bytes per file, "
                         f"{'O_DIRECT' if nvme.direct else 'buffered'} I/O")
        else:
            disk = {"nvme_read_gbps": 1.0, "nvme_write_gbps": 1.0, "nvme_bytes": 0}
            disk_note = "no NVMe folder given: nvme_bytes=0 keeps the planner off that tier"
        return CostTable.from_types(
            adapter.layer_types,
            type_costs,
            batch_size=batch_size,
            seq_len=seq_len,
            **constants,
            head_chunk_tokens=head_chunk_tokens,
            const_params=const_params,
            head_params=adapter.final_layout.numel,
            const_weight_bytes=const_params * esize,
            const_grad_bytes=const_params * esize,
            **disk,
            # per parameter of the model: a rank of local_world_size steps 1/local_world_size of it
            optimizer_ns_per_param=optimizer_ns / local_world_size,
            optimizer=optimizer,
            const_update_ms=const_update_ms,
            const_update_bytes=const_update_bytes,
            device_step_work_bytes=device_step_work_bytes,
            device_step_chunk=device_step_chunk,
            gpu_bytes=usable_gpu_bytes(gpu_bytes or total_gpu),
            # resident embedding and final group and their gradients; the CUDA context and the
            # allocator's slack come out of gpu_bytes (usable_gpu_bytes), not here
            gpu_fixed_bytes=2 * (store.weights[0].numel() + store.weights[-1].numel()) * esize,
            host_bytes=max(int(host_free), 0),
            fits=fits,
            attention=attention,
            elementwise=adapter.pointwise.kind,
            world_size=local_world_size,
            local_world_size=local_world_size,
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            notes={"profiled_shapes": [list(s) for s in shapes], "nvme": disk_note,
                   **({"copy_slowdown": {k.removeprefix("copy_slowdown_"): v for k, v in slowdowns.items()}}
                      if slowdowns else {})},
            **machine,
        )
    finally:
        # Something outlives the profile and still refers to its executor: on the H200 a plan
        # run after an in-process 9B profile started with this executor's resident groups and
        # two weight slots (5.0 GB) allocated, under every stage the simulator predicted. The run
        # or the training the profile is for needs that memory.
        executor.abandon()
        release_gpu_garbage(device)


def release_gpu_garbage(device: torch.device) -> None:
    """Collect unreachable Python objects now and give their GPU memory back to the caching
    allocator (and its cache to the driver): objects in reference cycles hold their tensors
    until Python's collector runs. The H100 runs of 2026-12-07 (Qwen3-30B-A3B) started their
    first plan with 3.22 GB allocated that the planner did not count, to the kilobyte a decoder
    layer's weights, bf16 gradient and 4-bit states on the GPU (plus the 0.07 GB every run
    starts with): the scratch step on which the profile times and sizes the GPU optimizer step
    (`const_update_costs`, `_device_step_work_bytes`), whose first call compiles it. Gone after
    the collection at that run's end: the first run peaked 3.2 GB above an identical second
    one, and a plan predicted at 80.3 GB ran out of memory at 84.3."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


CONSTANTS = ("embed_forward_ms", "embed_backward_ms", "embed_backward_work_bytes", "head_ms",
             "head_work_bytes", "head_token_bytes")
"""The `CostTable` fields `measure_constants` gives."""


def measure_constants(executor: Executor, store: HostStore, device: torch.device, batch_size: int,
                      seq_len: int, repeats: int = 3) -> dict:
    """The embedding's forward and backward and the final norm + chunked head + loss (forward
    and backward) at ``(batch_size, seq_len)``: times, and the working sets from the allocator's
    peaks (0 on the CPU), through the executor's own code.

    The head is measured at two token counts as well (the whole batch and half of it), for
    ``head_token_bytes``; the embedding's backward with every token distinct (its fp32 sums'
    largest size at this many tokens).
    """
    adapter = executor.adapter
    embed = store.weights[0].to(device)
    final = store.weights[-1].to(device)
    embed_leaf = adapter.layouts[0].leaves(embed)
    final_leaf = adapter.final_layout.leaves(final)
    embed_w = embed_leaf["embed_tokens.weight"]
    head_w = adapter.head_weight(embed_leaf, final_leaf)
    tokens = batch_size * seq_len
    ids = torch.randint(0, adapter.vocab_size, (batch_size, seq_len), device=device)
    distinct = (torch.arange(tokens, device=device) % adapter.vocab_size).view(batch_size, seq_len)

    with torch.no_grad():
        embed_forward_ms = time_ms(device, lambda: adapter.embed(embed_w, ids), repeats)

    def embed_backward() -> tuple[float, int]:
        # the gradient buffer is resident (in gpu_fixed_bytes), the incoming gradient is not
        grad_out = torch.zeros_like(embed_w)
        with _Peak(device) as peak:
            g = torch.randn(batch_size, seq_len, adapter.hidden_size, device=device, dtype=store.dtype)
            ms = time_ms(device, lambda: adapter.embed_backward(distinct, g, grad_out), repeats)
        return ms, peak.bytes

    embed_backward_ms, embed_backward_bytes = embed_backward()

    def head(rows: int) -> tuple[float, int]:
        x = torch.randn(rows, seq_len, adapter.hidden_size, device=device, dtype=store.dtype)
        n = rows * seq_len
        valid = torch.arange(n, device=device)
        targets = torch.randint(0, adapter.vocab_size, (n,), device=device)
        with _Peak(device) as peak:
            ms = time_ms(device, lambda: executor.head_loss_backward(
                x, final_leaf["model.norm.weight"], head_w, valid, targets, n), repeats)
        return ms, peak.bytes

    head_ms, head_bytes = head(batch_size)
    half = batch_size // 2
    head_token_bytes = 0.0
    if half >= 1:
        _, half_bytes = head(half)
        head_token_bytes = max(0.0, (head_bytes - half_bytes) / ((batch_size - half) * seq_len))
    return {
        "embed_forward_ms": embed_forward_ms,
        "embed_backward_ms": embed_backward_ms,
        "embed_backward_work_bytes": embed_backward_bytes,
        "head_ms": head_ms,
        "head_work_bytes": head_bytes,
        "head_token_bytes": head_token_bytes,
    }
