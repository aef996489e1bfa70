"""Host memory per component: predicted bytes match what a run holds (RSS), a model that does
not fit fails before allocating and names the smallest change, pinned buffers are not rounded."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from lazytrain.cli.main import main
from lazytrain.memory.budget import HostSettings, check_host_fit, host_budget, smallest_fix
from lazytrain.memory.host_store import HostMemoryError, pin_in_place
from lazytrain.memory.nvme import aligned_empty, padded_bytes
from lazytrain.model.adapter import ModelAdapter
from lazytrain.model.build import model_config

GIB = 2**30


def _numels(shape: str) -> list[int]:
    adapter = ModelAdapter(model_config(f"builtin:{shape}"), torch.device("cpu"), torch.bfloat16)
    return [layout.numel for layout in adapter.layouts]


def test_qwen25_14b_takes_8_06_bytes_per_param_with_split_master_and_8bit_states():
    numels = _numels("qwen2.5-14b")
    assert sum(numels) == 14_770_033_664  # Qwen2.5-14B: 14.77 B parameters, 48 layers, untied head
    split = host_budget(numels, HostSettings(torch.bfloat16, "split", "hybrid8bit"), limit=125 * GIB)
    whole = host_budget(numels, HostSettings(torch.bfloat16, "fp32", "hybrid8bit"), limit=125 * GIB)
    assert split.total / sum(numels) == pytest.approx(8.0625, abs=1e-3)
    assert whole.total / sum(numels) == pytest.approx(10.0625, abs=1e-3)
    assert split.fits and not whole.fits  # 110.9 GiB and 138.4 GiB against the H200 host's 125


def test_the_master_takes_4_2_or_0_bytes_per_param_by_mode():
    numels = _numels("qwen2.5-7b")
    n = sum(numels)
    masters = {mode: host_budget(numels, HostSettings(torch.bfloat16, mode, "hybrid8bit"), limit=GIB).state.masters
               for mode in ("fp32", "split", "bf16")}
    assert masters == {"fp32": 4 * n, "split": 2 * n, "bf16": 0}
    with pytest.raises(ValueError, match=r"master form 'half' is not one of \['fp32', 'split', 'bf16'\]"):
        host_budget(numels, HostSettings(torch.bfloat16, "half", "hybrid8bit"), limit=GIB)


@pytest.mark.parametrize(
    ("settings", "limit_gib", "fix"),
    [
        # 7B, 8-bit states: the split master alone (exact, so tried first) brings 71.3 GiB to 57.2
        (HostSettings(torch.bfloat16, "fp32", "hybrid8bit"), 64, "memory.master=split"),
        # 7B, fp32 states (113 GiB): the exact changes together leave 85 GiB; 8-bit states alone fit
        (HostSettings(torch.bfloat16, "fp32", "fp32"), 80,
         "optimizer.kind=hybrid8bit (not exact: optimizer.kind=hybrid8bit, see docs/memory.md and docs/optimizer.md)"),
        (HostSettings(torch.bfloat16, "fp32", "fp32"), 60, ("memory.master=split optimizer.kind=hybrid8bit (not exact: "
                                                            "optimizer.kind=hybrid8bit, see docs/memory.md and "
                                                            "docs/optimizer.md)")),
        # fp32 compute: no split or bf16 master to offer; held gradients (4 B/param there) and 8-bit states
        (HostSettings(torch.float32, "fp32", "fp32"), 80, ("memory.gradients=auto optimizer.kind=hybrid8bit (the "
                                                           "plan then holds each layer's gradient on the GPU until "
                                                           "its update, or puts it in a host buffer where the host "
                                                           "has room; not exact: optimizer.kind=hybrid8bit, see "
                                                           "docs/memory.md and docs/optimizer.md)")),
        (HostSettings(torch.float32, "fp32", "fp32"), 30, None),
        # fp32 compute (no bf16 master), gradients held: 4-bit states are what is left (76.6 -> 69.5 GiB)
        (HostSettings(torch.float32, "fp32", "hybrid8bit", held_grads=tuple(range(1, 29))), 72,
         "optimizer.kind=hybrid4bit (not exact: optimizer.kind=hybrid4bit, see docs/memory.md and docs/optimizer.md)"),
    ],
)
def test_smallest_fix(settings, limit_gib, fix):
    numels = _numels("qwen2.5-7b")
    budget = host_budget(numels, settings, limit=limit_gib * GIB)
    assert not budget.fits
    assert smallest_fix(numels, settings, budget) == fix


def test_the_flagship_fits_128_gib_with_held_gradients_and_a_bf16_master():
    """Qwen3.6-27B, 8-bit states, split master: 8.06 B/param (202 GiB) in a 118 GiB budget.
    Held gradients (exact) leave 152; with a bf16 master 102 GiB fits, and is named not exact;
    4-bit states with the split master (177) do not, nor does anything without held gradients."""
    numels = _numels("qwen3.6-27b")
    settings = HostSettings(torch.bfloat16, "split", "hybrid8bit")
    budget = host_budget(numels, settings, limit=118 * GIB)
    assert not budget.fits and budget.total / sum(numels) == pytest.approx(8.06, abs=0.01)
    fix = smallest_fix(numels, settings, budget)
    assert fix.startswith("memory.gradients=auto memory.master=bf16 (")
    assert "not exact: memory.master=bf16" in fix
    held = host_budget(numels, HostSettings(torch.bfloat16, "bf16", "hybrid8bit").holding_layer_grads(len(numels)),
                       limit=118 * GIB)
    # what stays: the embedding's and the untied head's buffers (1.27 B parameters each) and the
    # two-slot ring of the largest layer's gradient
    assert held.fits and held.state.grads == 2 * (numels[0] + numels[-1] + 2 * max(numels[1:-1]))
    assert held.total / sum(numels) == pytest.approx(4.31, abs=0.01)


def test_host_activations_are_counted_and_the_fix_can_be_fewer_of_them():
    numels = _numels("qwen2.5-7b")
    settings = HostSettings(torch.bfloat16, "split", "hybrid8bit")
    budget = host_budget(numels, settings, activations=15 * GIB, limit=64 * GIB)  # 57.2 + 15 GiB
    assert not budget.fits and "activations" in budget.table()
    # exact: the gradients held on the GPU (14.2 GiB of host buffers less the ring) make room
    assert smallest_fix(numels, settings, budget).startswith("memory.gradients=auto (")
    held = settings.holding_layer_grads(len(numels))
    budget = host_budget(numels, held, activations=25 * GIB, limit=64 * GIB)
    assert smallest_fix(numels, held, budget).startswith("no host-tier activations")
    with pytest.raises(HostMemoryError, match=r"(?s)activations +25\.00 GiB.*does NOT fit.*no host-tier"):
        check_host_fit(numels, held, budget)


def test_a_model_that_does_not_fit_fails_before_allocating(tmp_path, capsys):
    """qwen2.5-7b in 60 GiB: stops at the pre-flight (nothing allocated: the run would need
    71 GiB) and names the split master."""
    code = main(["train", f"training.output_dir={tmp_path}", "model.source=builtin:qwen2.5-7b",
                 "model.dtype=bf16", "optimizer.kind=hybrid8bit", "memory.master=fp32",
                 "memory.host_limit_gb=60", "training.progress=false"])
    err = capsys.readouterr().err
    assert code == 2
    assert "smallest change that fits: set memory.master=split" in err
    assert "masters" in err and "B/param" in err


_RSS_SCRIPT = textwrap.dedent("""
    import ctypes, gc, json, sys
    import torch
    from lazytrain.memory.budget import HostSettings, host_budget
    from lazytrain.memory.host_store import HostStore
    from lazytrain.model.build import build_model
    from lazytrain.model.shapes import SHAPES
    from lazytrain.optim.base import AdamWConfig
    from lazytrain.optim.hybrid8bit import Hybrid8bitAdamW
    from lazytrain.train.metrics import host_rss_bytes

    SHAPES["test-1b"] = {**SHAPES["qwen2.5-3b"], "num_hidden_layers": 9}  # 1.005 B parameters

    def run(source):
        adapter, store = build_model(source, torch.device("cpu"), torch.bfloat16, vocab_size=512,
                                     master="split", pin=False, store_factory=HostStore)
        opt = Hybrid8bitAdamW(store.masters, [g.decay_numel for g in adapter.layouts], AdamWConfig())
        for g, grad in enumerate(store.grads):  # every buffer written, as a training step does
            grad.fill_(1e-3)  # (RSS counts the pages written, not their values: normal_ took 5 s at 1B)
            opt.step_group(g, grad, 1.0, 1e-5, None)
        return adapter, store, opt

    def settle():
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return host_rss_bytes()

    run("builtin:tiny")  # imports, kernel, allocator warm
    before = settle()
    adapter, store, opt = run(sys.argv[1])
    grown = settle() - before
    numels = [g.numel for g in adapter.layouts]
    predicted = host_budget(numels, HostSettings(torch.bfloat16, "split", "hybrid8bit")).total
    print(json.dumps({"grown": grown, "predicted": predicted, "state": opt.state_bytes()}))
""")


def _rss_growth(source: str) -> dict:
    import json

    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, source], capture_output=True, text=True,
                         check=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "2"})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("source", ["builtin:tiny", pytest.param("builtin:test-1b", marks=pytest.mark.slow)])
def test_predicted_host_bytes_match_rss_growth(source):
    """Weights, split-master remainders, gradients and 8-bit states of a stepped model: the
    prediction is within 5% of the RSS the process grew by (the 1B shape holds ~8.1 GB)."""
    result = _rss_growth(source)
    assert result["grown"] == pytest.approx(result["predicted"], rel=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_activation_buffers_are_pinned_in_place_without_rounding():
    nbytes = 3 * 2**20 + 5  # torch's pinned allocator would take 4 MiB
    buf = aligned_empty(nbytes, torch.uint8, pin=True)
    assert buf.is_pinned()
    assert buf.data_ptr() % 4096 == 0
    assert padded_bytes(nbytes) == 3 * 2**20 + 4096


class _FakeCudart:
    """cudaHostRegister / cudaHostUnregister that record the ranges pinned now."""

    def __init__(self):
        self.pinned: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.pinned[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        del self.pinned[ptr]
        return 0


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_aligned_buffers_stay_pinned_while_they_live(monkeypatch, dtype):
    """The pinning of an activation-store buffer lasts exactly as long as the tensor returned.
    It used to be released as soon as `aligned_empty` returned: the finalizer sat on the raw
    allocation's Python object, which a dtype view does not keep alive, so every host-tier
    activation was copied unpinned (7.7 GB/s to the GPU on the H200 machine instead of 52)."""
    import gc

    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    nbytes = 3 * 2**20 + 6
    buf = aligned_empty(nbytes // dtype.itemsize, dtype, pin=True)
    gc.collect()
    assert cudart.pinned == {buf.data_ptr(): padded_bytes(nbytes)}
    # torch's is_pinned() asks whether the *storage's* first byte is pinned: the range must
    # start there (on the H200 a buffer cut from a larger allocation reported False)
    assert buf.untyped_storage().data_ptr() == buf.data_ptr()
    assert cudart.unregistered == []
    flat = buf.view(-1).view(torch.uint8)  # what the store copies through: views, the buffer kept
    del flat
    gc.collect()
    assert buf.data_ptr() in cudart.pinned
    ptr = buf.data_ptr()
    del buf
    gc.collect()
    assert cudart.unregistered == [ptr] and cudart.pinned == {}


def test_pinning_needs_one_contiguous_range(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", _FakeCudart)
    with pytest.raises(ValueError, match="contiguous"):
        pin_in_place(torch.randn(3 * 4096 + 7)[::2])


GB = 10**9


def test_activation_room_is_bounded_by_the_memory_available_now(monkeypatch):
    """The host room for activations is the budget less the model state, and no more than the
    machine has available less the headroom (the process's own memory, other processes and the
    kernel, which the budget's components do not count); data-parallel ranks on one host share
    both bounds. On the H200 machine a plan that used the whole budget was killed by the kernel."""
    from lazytrain.memory import host_store

    monkeypatch.setattr(host_store, "host_memory_total", lambda: 135 * GB)
    headroom = host_store.host_headroom()
    assert headroom == int(135 * GB * host_store.HOST_HEADROOM_FRACTION)
    monkeypatch.setattr(host_store, "host_memory_available", lambda: 70 * GB)
    # the budget's bound: 128 - 61 = 67 GB; the machine's: 70 GB available less the headroom
    assert host_store.activation_room(61 * GB, limit=128 * GB) == 70 * GB - headroom
    assert host_store.activation_room(61 * GB, limit=100 * GB) == 39 * GB  # a smaller budget binds
    assert host_store.activation_room(20 * GB, limit=128 * GB, ranks=2) == (70 * GB - headroom) // 2
    assert host_store.activation_room(40 * GB, limit=128 * GB, ranks=2) == 24 * GB  # 64 GB each, 40 held
    assert host_store.activation_room(130 * GB, limit=128 * GB) == 0  # never negative
    monkeypatch.setattr(host_store, "host_memory_available", lambda: None)  # unknown: the budget alone
    assert host_store.activation_room(61 * GB, limit=128 * GB) == 67 * GB


def test_memory_available_counts_a_containers_limit(tmp_path):
    """In a cgroup with a memory limit the machine's MemAvailable overstates: what the limit
    leaves (usage less inactive file pages) is taken when smaller; no limit ("max"), none."""
    from lazytrain.memory.host_store import _cgroup_available

    (tmp_path / "memory.max").write_text("10000000000\n")
    (tmp_path / "memory.current").write_text("7000000000\n")
    (tmp_path / "memory.stat").write_text("anon 6000000000\nfile 1000000000\ninactive_file 500000000\n")
    assert _cgroup_available(str(tmp_path)) == 3_500_000_000
    (tmp_path / "memory.max").write_text("max\n")
    assert _cgroup_available(str(tmp_path)) is None
    assert _cgroup_available(str(tmp_path / "absent")) is None


def test_the_cost_table_and_a_saved_one_get_the_room_available_now(tmp_path, monkeypatch):
    """The profiler's table, and a saved table given to a later run, plan host activations within
    what the machine has available then, not only within the budget."""
    from lazytrain.config import load_config
    from lazytrain.memory import host_store
    from lazytrain.train.session import build_session

    overrides = [f"training.output_dir={tmp_path / 'run'}", "training.batch_size=2", "data.max_seq_len=32",
                 "data.builtin_train_size=8", "data.heldout_size=2", "training.progress=false"]
    session = build_session(load_config(None, overrides))
    roomy = session.cost_table()
    available = host_store.host_headroom() + 3 * 2**20  # 3 MiB above the headroom
    monkeypatch.setattr(host_store, "host_memory_available", lambda: available)
    assert roomy.host_bytes > 3 * 2**20
    assert session.cost_table().host_bytes == 3 * 2**20
    roomy.save(tmp_path / "costs.json")
    later = build_session(load_config(None, [*overrides, f"plan.costs={tmp_path / 'costs.json'}"]))
    assert later.cost_table().host_bytes == 3 * 2**20
    # data parallel: this rank's state (as the profiler counts it) and its share of the room,
    # read once every rank has allocated its state
    from types import SimpleNamespace

    monkeypatch.setattr(host_store, "host_memory_available", lambda: host_store.host_headroom() + 2**30)
    waits = []
    later.parallel = SimpleNamespace(info=SimpleNamespace(local_world_size=2), barrier=lambda: waits.append(1))
    state = later.store.bytes(later.optimizer.state_bytes()).total
    assert later.for_this_run(roomy).host_bytes == min(host_store.default_host_limit() // 2 - state, 2**29)
    assert waits == [1]


def test_a_model_that_fits_only_with_held_gradients_builds_and_plans_within_the_budget(tmp_path, monkeypatch):
    """``memory.gradients=auto`` under a budget below the state with every gradient buffer and
    above it with every decoder layer's held (the 27B on 128 GiB, at tiny-hybrid's scale; on 2
    layers the pinned ring is as large as the buffers it spares): the store is built (its own
    check counted every buffer and refused), the plan's room is the budget less the state with
    only the buffers every plan allocates (it was the table's room, floored at 0, plus the
    layers' buffers: more than the budget has), and the first plan holds what does not fit."""
    from lazytrain.config import load_config
    from lazytrain.memory import host_store
    from lazytrain.train.session import build_session, host_limit_bytes

    monkeypatch.setattr(host_store, "host_memory_available", lambda: 2**40)  # the budget binds
    base = ["model.source=builtin:tiny-hybrid", "memory.gradients=auto", f"training.output_dir={tmp_path}",
            "training.batch_size=2", "data.max_seq_len=32", "training.progress=false", "plan.policy=solved"]
    roomy = build_session(load_config(None, base))
    state = roomy.store.bytes(roomy.optimizer.state_bytes())  # (every buffer, none allocated yet)
    sizes, dtype = roomy.store.grad_sizes, roomy.store.dtype
    layer_grads = sum(sizes[1:-1]) * dtype.itemsize
    least = state.total - layer_grads - host_store.grad_ring_bytes(0, dtype) + host_store.grad_ring_bytes(
        max(sizes[1:-1]), dtype)
    gib = (least + state.total) / 2 / GIB
    tight = build_session(load_config(None, [*base, f"memory.host_limit_gb={gib}"]))
    limit = host_limit_bytes(tight.config)
    assert least < limit < state.total
    costs = tight.cost_table()
    assert costs.host_bytes == limit - least and not costs.host_grads
    assert costs.host_bytes < layer_grads  # some layer's gradient must wait on the GPU
    plan, _ = tight.plan()
    host = sum(sizes[i + 1] for i, lp in enumerate(plan.layers) if lp.grad == "host") * dtype.itemsize
    # within the room; whether the plan uses any of it depends on the CPU profile's timings
    # (a loaded CI machine's plan held every gradient once), so only the bound is checked
    assert host + tight.planner.predicted.get("predicted_act_host_gb", 0.0) * 1e9 <= limit - least
    assert any(lp.grad == "gpu" for lp in plan.layers)
    # a baseline policy holds none under auto: stopped before anything is allocated (it once
    # passed here and then pinned every layer's buffer), pointed to gpu, with which it builds
    tight_megatrain = [*base[:-1], f"memory.host_limit_gb={gib}", "plan.policy=megatrain"]
    with pytest.raises(HostMemoryError, match=r"smallest change that fits: set memory.gradients=gpu \(plan.policy="
                                              r"megatrain holds .* or set plan.policy=auto"):
        build_session(load_config(None, tight_megatrain))
    session = build_session(load_config(None, [*tight_megatrain, "memory.gradients=gpu"]))
    plan, _ = session.plan()
    assert plan.policy == "megatrain" and all(lp.grad == "gpu" for lp in plan.layers)


def test_a_new_host_tier_buffer_stops_with_a_message_when_memory_ran_short(monkeypatch):
    """A host-tier activation buffer is page-locked on a GPU machine: when the machine has run
    short since planning, the store raises a clear error instead of being killed by the kernel;
    a buffer taken from its pool allocates nothing and is not checked."""
    from lazytrain.memory import host_store
    from lazytrain.runtime.activations import ActivationStore
    from lazytrain.runtime.streams import Streams

    cpu = torch.device("cpu")
    store = ActivationStore(Streams(cpu), cpu)
    handle = store.put(torch.randn(1024), "host")
    store.get(handle)
    store.free(handle)
    monkeypatch.setattr(host_store, "host_memory_available", lambda: host_store.HOST_FLOOR_BYTES + 4096)
    store.free(store.put(torch.randn(1024), "host"))  # its pooled buffer: fine
    with pytest.raises(HostMemoryError, match=r"host-tier activation buffer needs .* memory.host_limit_gb"):
        store.put(torch.randn(4096), "host")


def _varying_steps(store, lengths, layers=4, slots=True):
    """Steps whose host tier holds ``layers`` tensors of each length's rows, then frees them (as
    the executor does, slotted by layer or not); -> the bytes lent at each step's peak."""
    peaks = []
    for length in lengths:
        store.start_step()
        handles = [store.put(torch.full((length, 1000), float(i)), "host", slot=(i, 0) if slots else None)
                   for i in range(layers)]
        peaks.append(store._lent_bytes)
        for i, handle in enumerate(handles):
            assert torch.equal(store.get(handle), torch.full((length, 1000), float(i)))
            store.free(handle)
    return peaks


LENGTHS_VARYING = [300, 310, 700, 420, 900, 650, 1024, 333, 1000, 1024]


def test_host_tier_buffers_settle_on_each_slots_longest_when_batch_lengths_vary(monkeypatch):
    """Padded SFT batches change length every step. A host-tier tensor reuses its slot's buffer
    (the same saved tensor of the same layer every step), replaced by a larger one only when it
    does not fit: the buffers held are each slot's longest, and once the longest length has come
    nothing more is pinned. (Kept by exact size in one pool they grew by a step's worth per new
    length until the kernel killed a 7B run on the H200 machine.) The evicted buffer is gone
    before its replacement is made."""
    from lazytrain.memory.nvme import padded_bytes
    from lazytrain.runtime import activations
    from lazytrain.runtime.activations import ActivationStore
    from lazytrain.runtime.streams import Streams

    cpu = torch.device("cpu")
    store = ActivationStore(Streams(cpu), cpu)
    made, bases = [], []
    real_empty = activations.aligned_empty

    def tracking_empty(*a, **k):
        # every buffer made so far is still the store's, or gone (an evicted one is freed first)
        alive = sum(ref() is not None for ref in bases)
        made.append(alive == len(store._lent) + len(store._slots) + len(store._idle))
        bases.append(weakref.ref(base := real_empty(*a, **k)))
        return base

    monkeypatch.setattr(activations, "aligned_empty", tracking_empty)
    peaks = _varying_steps(store, LENGTHS_VARYING)
    longest = 4 * padded_bytes(1024 * 1000 * 4)
    assert store.host_buffer_bytes == max(peaks) == longest
    # grown at 300, 310, 700, 900 and 1024 rows only, and the old one freed first each time
    assert len(made) == 4 * 5 and all(made)
    made.clear()
    _varying_steps(store, [1024, 900, 333, 1024])
    assert made == [] and store.host_buffer_bytes == longest


def test_the_host_tier_takes_back_an_abandoned_steps_buffers_and_frees_all_when_closed():
    """A step abandoned with its host-tier tensors stored (an out-of-memory error, an
    interrupt) leaves their buffers lent: the next step takes them back into their slots instead
    of pinning new ones, and an executor given up frees every buffer (`close`)."""
    from lazytrain.runtime.activations import ActivationStore
    from lazytrain.runtime.streams import Streams

    cpu = torch.device("cpu")
    store = ActivationStore(Streams(cpu), cpu)
    store.start_step()
    for i in range(3):
        store.put(torch.randn(500, 1000), "host", slot=(i, 0))  # never freed: the step failed
    held = store.host_buffer_bytes
    _varying_steps(store, [500, 400], layers=3)
    assert store.host_buffer_bytes == held and store._lent_bytes == 0
    store.close()
    assert store.host_buffer_bytes == 0 and not store._slots and not store._idle


def test_nvme_staging_buffers_stay_within_the_most_ever_lent_when_batch_lengths_vary(monkeypatch):
    """The NVMe tier's staging buffers (no slot) come from a pool: one up to 1.25x larger serves a
    tensor, and before a new one is made idle ones are freed until the buffers held are no more
    than the most ever lent at once; a step of full rows reuses its buffers exactly."""
    from lazytrain.memory.nvme import padded_bytes
    from lazytrain.runtime import activations
    from lazytrain.runtime.activations import ActivationStore
    from lazytrain.runtime.streams import Streams

    cpu = torch.device("cpu")
    store = ActivationStore(Streams(cpu), cpu)
    peak = 0
    for length in LENGTHS_VARYING:
        peak = max(peak, *_varying_steps(store, [length], slots=False))
        assert store.host_buffer_bytes <= peak
    assert peak == 4 * padded_bytes(1024 * 1000 * 4)
    held = store.host_buffer_bytes
    made = []
    real_empty = activations.aligned_empty
    monkeypatch.setattr(activations, "aligned_empty", lambda *a, **k: made.append(a) or real_empty(*a, **k))
    _varying_steps(store, [1024, 900, 1024, 900, 1024, 900], slots=False)  # within 1.25x: reused
    assert made == [] and store.host_buffer_bytes == held
