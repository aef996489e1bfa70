"""Host-to-GPU and GPU-to-host copy speed of host memory pinned in different ways.

    python -m bench.studies.pinned_copy --gb 2 --out bench/results

The activation store's buffers (`memory.nvme.aligned_empty(pin=True)`) and the host store's
arenas are page-locked in place with cudaHostRegister (`memory.host_store.pin_in_place`).
Per way of pinning, one ``--gb`` GB buffer, copied ``--repeats`` times each way (median, CUDA
events), with the host memory available at the time:

- ``pageable``: torch.empty, not pinned (the speed an unpinned buffer gets);
- ``allocated``: torch.empty(pin_memory=True) (cudaHostAlloc);
- ``registered_untouched``: 4 KiB-aligned, registered before any of its pages is written;
- ``aligned_empty``: `aligned_empty(pin=True)`, what the activation store uses;
- ``released_on_return``: what `aligned_empty(pin=True)` did until the pinning's owner was
  explicit: registered, then returned as a dtype view with the unpinning tied to the raw
  allocation's Python object, which dies on return (the buffer is then unpinned);
- ``registered_touched``: 4 KiB-aligned, zeroed, then pinned;
- ``registered_touched_2mib``: the same at a 2 MiB-aligned address;
- ``registered_unaligned``: torch.empty, zeroed, registered as it is (what the host store does
  with its weight and gradient arenas).
"""

from __future__ import annotations

import argparse
import json
import statistics
import weakref

import torch

from bench.common import run_header, today, write_results
from lazytrain.memory.host_store import host_memory_available, pin_in_place
from lazytrain.memory.nvme import ALIGN, aligned_empty


def register_untouched(nbytes: int) -> torch.Tensor:
    """A 4 KiB-aligned buffer registered with cudaHostRegister before any of its pages is
    written (a slice: it keeps the raw allocation's Python object, and so its pinning, alive)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    view = raw[start : start + nbytes]
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(view.data_ptr(), nbytes, 0)
    if int(err if not isinstance(err, tuple) else err[0]) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    weakref.finalize(raw, cudart.cudaHostUnregister, view.data_ptr())
    return view


def released_on_return(nbytes: int) -> torch.Tensor:
    """`aligned_empty(pin=True)` before its fix: the unpinning tied to ``raw``, a dtype view
    returned (it keeps the storage, not ``raw``'s Python object: unpinned on return)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    pin_in_place(raw[start : start + nbytes], owner=raw)
    return raw[start : start + nbytes].view(torch.uint8)


def buffers(nbytes: int):
    yield "pageable", torch.empty(nbytes, dtype=torch.uint8)
    yield "allocated", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    yield "registered_untouched", register_untouched(nbytes)
    yield "aligned_empty", aligned_empty(nbytes, torch.uint8, pin=True)
    yield "released_on_return", released_on_return(nbytes)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    raw.zero_()
    pin_in_place(raw[start : start + nbytes])
    yield "registered_touched", raw[start : start + nbytes]
    del raw
    huge = 2 * 2**20
    raw = torch.empty(nbytes + huge, dtype=torch.uint8)
    start = (-raw.data_ptr()) % huge
    raw.zero_()
    pin_in_place(raw[start : start + nbytes])
    yield "registered_touched_2mib", raw[start : start + nbytes]
    del raw
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.zero_()
    pin_in_place(t)
    yield "registered_unaligned", t


def timed_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(nbytes: int, repeats: int = 3) -> list[dict]:
    device = torch.device("cuda")
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rows = []
    for how, host in buffers(nbytes):
        h2d = timed_copy(gpu, host, repeats)
        d2h = timed_copy(host, gpu, repeats)
        rows.append({"pinning": how, "bytes": nbytes, "h2d_gbps": nbytes / h2d / 1e6, "d2h_gbps": nbytes / d2h / 1e6,
                     "host_available_gb": (host_memory_available() or 0) / 1e9})
        print(json.dumps(rows[-1]), flush=True)
        del host
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pinned_copy needs a CUDA device")
    rows = measure(int(args.gb * 1e9), args.repeats)
    header = run_header(torch.device("cuda"))
    records = [{"name": f"pinned_copy_{r['pinning']}", **header, **r} for r in rows]
    lines = [f"# Copy speed by way of pinning host memory ({today()}, {header['device']})", "",
             f"`python -m bench.studies.pinned_copy --gb {args.gb:g} --repeats {args.repeats}` (median of the repeats)", "",
             "| pinning | H2D GB/s | D2H GB/s |", "|---|---|---|"]
    lines += [f"| {r['pinning']} | {r['h2d_gbps']:.1f} | {r['d2h_gbps']:.1f} |" for r in rows]
    write_results(records, f"pinned_copy_{today()}", "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
