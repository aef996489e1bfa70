"""Data parallel on gloo (2 and 3 CPU processes) equals single-process training of the same
global batches: per-step losses, final weights, every rank's master shard; resume after a
kill; one shared weight arena per host and 1/N of the masters per rank."""

from __future__ import annotations

import itertools
import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from lazytrain.config import load_config
from lazytrain.memory.shard import SHARD_ALIGN, shard_decay_numel, shard_range
from lazytrain.optim.base import AdamWConfig
from lazytrain.optim.hybrid8bit import Hybrid8bitAdamW
from lazytrain.optim.quant import BLOCK
from lazytrain.runtime.distributed import DistributedError, local_batch_size, rank_info_from_env
from lazytrain.train.checkpoint import Checkpointer, CheckpointError
from lazytrain.train.trainer import Trainer

COMMON = ["training.progress=false", "data.builtin_train_size=64", "data.heldout_size=1",
          "optimizer.warmup_steps=1", "training.max_grad_norm=0.5", "optimizer.weight_decay=0.1"]

BACKENDS = ["cpp", "torch"]
"""``cpp`` requires the kernel: where it does not build the test fails with the compiler's
message (issue 54: a kernel that does not build fails loudly, it does not skip)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _arena_inodes() -> set[str]:
    """Inodes of this process's mappings of a shared weight arena."""
    with open("/proc/self/maps") as f:
        return {line.split()[4] for line in f if "lazytrain-" in line and ".weights" in line}


def _worker(rank: int, world: int, local_world: int, port: int, overrides: list[str], kill_at: int) -> None:
    os.environ.update(
        LAZYTRAIN_OPTIM_KERNEL="torch",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local_world), LOCAL_WORLD_SIZE=str(local_world),
        GROUP_RANK=str(rank // local_world),
    )
    trainer = Trainer(load_config(None, overrides))
    trainer.setup()
    out = Path(trainer.config.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = trainer.store
    (out / f"rank{rank}.json").write_text(json.dumps({
        "arena_inodes": sorted(_arena_inodes()),
        "master_numel": sum(m.numel() for m in store.masters),
        "grad_numel": sum(g.numel() for g in store.grads if g is not None),
        "grad_groups": sorted(store.host_grad_groups),
        "shard_numels": [r.numel for r in store.ranges],
        "num_params": store.num_params,
    }))
    if kill_at:
        run_step = trainer.executor.forward_backward

        def forward_backward(*args, **kwargs):
            if trainer.step == kill_at:
                os._exit(0)  # killed mid-run: no checkpoint, no clean shutdown
            return run_step(*args, **kwargs)

        trainer.executor.forward_backward = forward_backward
    trainer.train()


def run_ranks(world: int, overrides: list[str], shm_dir: Path, *, local_world: int | None = None,
              kill_at: int = 0) -> None:
    """``world`` ranks of ``local_world`` a host, their shared weight arenas in ``shm_dir`` (the
    test's, not the machine's /dev/shm)."""
    overrides = [*overrides, f"memory.shm_dir={shm_dir}"]
    shm_dir.mkdir(exist_ok=True)
    # forkserver: one server imports torch and lazytrain once per session and forks every rank
    # from there (seconds saved per process on a busy 2-core machine; the server never ran
    # torch work, so no OpenMP state is forked)
    mp.set_forkserver_preload(["lazytrain.train.trainer", "test_distributed"])
    mp.start_processes(_worker, args=(world, local_world or world, _free_port(), overrides, kill_at),
                       nprocs=world, start_method="forkserver")


def run_single(overrides: list[str]) -> Trainer:
    assert "WORLD_SIZE" not in os.environ  # conftest clears the caller's torchrun variables
    trainer = Trainer(load_config(None, overrides))
    trainer.setup()
    trainer.train()
    return trainer


def losses(out: Path) -> dict[int, float]:
    """Loss per step (a resumed run's records replace the killed run's)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def assert_same_training(single: Path, ranks: Path, world: int, steps: int, code_flips: bool = False) -> None:
    """Same losses per step (rtol 1e-5), same masters and model. ``code_flips``: 8-bit
    states, where an fp32 rounding difference in a gradient (the ranks' parts summed in
    another order) can move a moment across a code midpoint: a few elements in 10^4 then
    differ by a fraction of one step."""
    want, got = losses(single), losses(ranks)
    assert sorted(got) == list(range(1, steps + 1))
    for step in want:
        torch.testing.assert_close(got[step], want[step], rtol=1e-5, atol=0, msg=f"step {step}")
    # every rank's masters are its element range of the single-process masters; atol: Adam
    # divides by sqrt(v), so for a near-zero gradient element the fp32 rounding of summing
    # the ranks' parts becomes up to ~1e-3 of a step (lr 2e-3): 1e-5 is 0.5% of one step
    full = load_file(str(Checkpointer(single).latest().path / "masters.safetensors"))
    for rank in range(world):
        name = f"masters-rank{rank:05d}-of-{world:05d}.safetensors"
        shard = load_file(str(Checkpointer(ranks).latest().path / name))
        for key, value in full.items():
            r = shard_range(value.numel(), world, rank)
            want = value[r.start : r.stop]
            if code_flips and want.numel():
                off = (shard[key] - want).abs() > 1e-5 + 1e-5 * want.abs()
                assert off.float().mean() < 1e-4, key
                torch.testing.assert_close(shard[key], want, rtol=0, atol=0.1 * 2e-3, msg=key)
            else:
                torch.testing.assert_close(shard[key], want, rtol=1e-5, atol=1e-5, msg=key)
    # rank 0's model folder holds the whole model
    a, b = load_file(str(single / "model.safetensors")), load_file(str(ranks / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=0.1 * 2e-3 if code_flips else 1e-5, msg=key)


def test_shard_boundaries_are_8bit_blocks():
    assert SHARD_ALIGN == BLOCK
    for numel, world in [(1, 3), (4096, 3), (10_000, 2), (33_000, 8)]:
        ranges = [shard_range(numel, world, r) for r in range(world)]
        assert ranges[0].start == 0 and ranges[-1].stop == numel
        for a, b in itertools.pairwise(ranges):
            assert a.stop == b.start and (b.start % BLOCK == 0 or b.start == numel)
        assert len({r.chunk for r in ranges}) == 1 and ranges[0].chunk * world >= numel


def test_launch_errors_say_what_to_do(monkeypatch):
    with pytest.raises(DistributedError, match="multiple of 4"):
        local_batch_size(6, 4)
    assert local_batch_size(8, 4) == 2
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(DistributedError, match="same --nproc-per-node"):
        rank_info_from_env()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("GROUP_RANK", "1")
    info = rank_info_from_env()
    assert (info.num_nodes, info.node_of(1), info.is_main) == (2, 0, False)


def test_two_ranks_equal_one_process_and_share_the_weights(tmp_path):
    """fp32 AdamW, 2 ranks on one host: same losses and weights; the weights are one arena
    both ranks map, the masters and gradients are halves."""
    args = [*COMMON, "training.batch_size=4", "training.steps=3"]
    run_single([*args, f"training.output_dir={tmp_path / 'single'}"])
    run_ranks(2, [*args, f"training.output_dir={tmp_path / 'dp'}"], tmp_path / "shm")
    assert_same_training(tmp_path / "single", tmp_path / "dp", 2, 3)
    reports = [json.loads((tmp_path / "dp" / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(reports[0]["arena_inodes"]) == 1
    assert reports[0]["arena_inodes"] == reports[1]["arena_inodes"]
    total = reports[0]["num_params"]
    assert sum(r["master_numel"] for r in reports) == total
    for r in reports:
        assert r["master_numel"] <= total / 2 + 2 * SHARD_ALIGN * 8  # a group's padding at most
        assert r["grad_numel"] == r["master_numel"]
    assert not list((tmp_path / "shm").iterdir())  # the arena was unlinked once mapped
    # only rank 0 writes metrics: one record per step
    records = (tmp_path / "dp" / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in line for line in records) == 3


def test_two_ranks_train_a_mixture_of_experts_as_one_process(tmp_path):
    """Qwen3-MoE with the router's load-balancing loss: the loss of the global batch (each rank's
    expert counts and probability sums summed over the ranks, the term added once), so the same
    losses and weights as one process."""
    from conftest import make_hf_model

    from lazytrain.data.tokenizer import builtin_tokenizer

    folder, tokenizer = tmp_path / "model", builtin_tokenizer()
    make_hf_model("qwen3_moe", layers=2, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    args = [*COMMON, "training.batch_size=4", "training.steps=3", f"model.source={folder}"]
    run_single([*args, f"training.output_dir={tmp_path / 'single'}"])
    run_ranks(2, [*args, f"training.output_dir={tmp_path / 'dp'}"], tmp_path / "shm")
    assert_same_training(tmp_path / "single", tmp_path / "dp", 2, 3)


def test_two_ranks_holding_a_gradient_on_the_device_train_as_with_host_buffers(tmp_path):
    """A plan file holding layer 1's gradient on the device (`LayerPlan.grad="gpu"`: each rank
    holds its reduce-scattered shard, then brings it home through its ring): the same losses and
    master shards, bit for bit, as the same plan with every gradient in the host shards, and no
    host shard for that layer."""
    from lazytrain.plan.plan import megatrain_plan

    args = [*COMMON, "training.batch_size=4", "training.steps=3"]
    for run, grad in (("host", "host"), ("held", "gpu")):
        plan = megatrain_plan(2, 2, 8)
        plan.layers[1].grad = grad
        plan.save(tmp_path / f"{run}.json")
        run_ranks(2, [*args, f"plan.file={tmp_path / run}.json", f"training.output_dir={tmp_path / run}"],
                  tmp_path / f"shm-{run}")
    assert losses(tmp_path / "held") == losses(tmp_path / "host") and len(losses(tmp_path / "host")) == 3
    for rank in range(2):
        name = f"masters-rank{rank:05d}-of-00002.safetensors"
        host, held = (load_file(str(Checkpointer(tmp_path / run).latest().path / name)) for run in ("host", "held"))
        for key in host:
            assert torch.equal(host[key], held[key]), key
        full, part = (json.loads((tmp_path / run / f"rank{rank}.json").read_text()) for run in ("host", "held"))
        assert full["grad_groups"] == [0, 1, 2, 3] and part["grad_groups"] == [0, 1, 3]
        assert full["grad_numel"] - part["grad_numel"] == full["shard_numels"][2] > 0


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_sharded_8bit_steps_are_bitwise_the_unsharded(world, backend, rounding):
    """Given the same gradient, the ranks' 8-bit optimizers over 128-aligned shards produce
    exactly the unsharded masters, weights and states (same blocks, same absmax; with
    stochastic rounding the same draws, from the shards' offsets in their groups)."""
    # 8-bit, fp32 (small), 8-bit, and a small group that leaves the last rank an empty shard
    # starting at the group's end (not a block multiple)
    numels = [4096 + 300, 1000, 20_000, 100]
    decay = [4096, 1000, 19_000, 100]
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=gen) for n in numels]
    grads = [[torch.randn(n, generator=gen) for n in numels] for _ in range(3)]
    config = AdamWConfig(lr=1e-2, weight_decay=0.1)
    full = Hybrid8bitAdamW([m.clone() for m in masters], decay, config, kernel=backend, rounding=rounding, seed=4)
    weights = [torch.empty(n) for n in numels]
    ranks = []
    for rank in range(world):
        ranges = [shard_range(n, world, rank) for n in numels]
        shard = Hybrid8bitAdamW([m[r.start : r.stop].clone() for m, r in zip(masters, ranges)],
                                [shard_decay_numel(d, r) for d, r in zip(decay, ranges)], config,
                                kernel=backend, group_numels=numels, group_offsets=[r.start for r in ranges],
                                rounding=rounding, seed=4)
        ranks.append((ranges, shard, [torch.empty(r.numel) for r in ranges]))
    for step_grads in grads:
        for g, grad in enumerate(step_grads):
            full.step_group(g, grad, 0.7, 1e-2, weights[g])
            for ranges, shard, out in ranks:
                r = ranges[g]
                if r.numel:
                    shard.step_group(g, grad[r.start : r.stop], 0.7, 1e-2, out[g])
    for g in range(len(numels)):
        full_state = full.states[g].tensors()
        for ranges, shard, out in ranks:
            r = ranges[g]
            assert torch.equal(shard.masters[g], full.masters[g][r.start : r.stop])
            assert torch.equal(out[g], weights[g][r.start : r.stop])
            for name, t in shard.states[g].tensors().items():
                per_block = "absmax" in name
                lo, hi = (r.start // BLOCK, -(-r.stop // BLOCK)) if per_block else (r.start, r.stop)
                assert torch.equal(t, full_state[name][lo:hi]), (g, name)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_three_ranks_hybrid8bit_equal_one_process(tmp_path, monkeypatch, rounding):
    """The 8-bit optimizer over 3 ranks' shards trains like one process."""
    monkeypatch.setenv("LAZYTRAIN_OPTIM_KERNEL", "torch")
    args = [*COMMON, "optimizer.kind=hybrid8bit", f"optimizer.state_rounding={rounding}",
            "training.batch_size=6", "training.steps=2"]
    run_single([*args, f"training.output_dir={tmp_path / 'single'}"])
    run_ranks(3, [*args, f"training.output_dir={tmp_path / 'dp'}"], tmp_path / "shm")
    assert_same_training(tmp_path / "single", tmp_path / "dp", 3, 2, code_flips=True)


def test_two_hosts_resume_after_kill_equals_uninterrupted(tmp_path):
    """Two ranks as two hosts (each its own weight copy, shards all-gathered), killed in step
    4 with the checkpoint of step 2, resumed to step 5: equal to 5 uninterrupted steps of
    one process. Resuming with another world size is refused."""
    args = [*COMMON, "training.batch_size=4", "training.steps=5", "training.save_every=2"]
    dp = [*args, f"training.output_dir={tmp_path / 'dp'}"]
    run_single([*args, f"training.output_dir={tmp_path / 'single'}"])
    run_ranks(2, dp, tmp_path / "shm", local_world=1, kill_at=3)
    assert not (tmp_path / "dp" / "model.safetensors").exists()
    run_ranks(2, [*dp, "training.resume=true"], tmp_path / "shm", local_world=1)
    assert_same_training(tmp_path / "single", tmp_path / "dp", 2, 5)
    with pytest.raises(CheckpointError, match="2 ranks"):
        Trainer(load_config(None, [*dp, "training.resume=true"])).setup()


def _checkpoint_worker(rank: int, world: int, port: int, out: str, fail_rank: int, phase: str) -> None:
    import errno

    import torch.distributed as dist

    import lazytrain.train.checkpoint as ckpt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def agree(ok: bool) -> bool:
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    checkpointer = Checkpointer(Path(out), rank=rank, world_size=world, agree=agree)
    masters, state = [torch.full((8,), float(rank))], {"step_count": torch.tensor(1)}
    checkpointer.save(1, masters, state, {})  # a good one first
    real_write = ckpt.write_safetensors

    def write(path, tensors, **kwargs):
        if rank == fail_rank and phase == "write":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, tensors, **kwargs)

    ckpt.write_safetensors = write
    if rank == fail_rank and phase == "space":
        checkpointer.check_room = lambda size, **kwargs: (_ for _ in ()).throw(CheckpointError("no room (simulated)"))
    try:
        checkpointer.save(2, masters, state, {})
        outcome = "saved"
    except CheckpointError as error:
        outcome = f"CheckpointError: {error}"
    Path(out, f"outcome{rank}.txt").write_text(outcome)
    dist.destroy_process_group()


@pytest.mark.parametrize("fail_rank, phase", [(1, "write"), (0, "write"), (1, "space")])
def test_a_rank_that_fails_its_checkpoint_part_stops_every_rank(tmp_path, fail_rank, phase):
    # before, the failing rank raised and the others waited at the next barrier for ever
    mp.set_forkserver_preload(["lazytrain.train.trainer", "test_distributed"])
    ctx = mp.start_processes(_checkpoint_worker, args=(2, _free_port(), str(tmp_path), fail_rank, phase), nprocs=2,
                             start_method="forkserver", join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail("a rank is still waiting after the other's checkpoint failure")
    outcomes = [(tmp_path / f"outcome{r}.txt").read_text() for r in range(2)]
    assert all(o.startswith("CheckpointError") for o in outcomes), outcomes
    assert ("disk filled up" if phase == "write" else "no room") in outcomes[fail_rank]
    assert "another rank failed" in outcomes[1 - fail_rank]
    # the good checkpoint is the latest and complete; nothing half-written is left
    found = Checkpointer(tmp_path, world_size=2).latest()
    assert found is not None and found.step == 1
    assert not list((tmp_path / "checkpoints").glob(".partial-*"))
