"""The SFT recipe: config -> session (model, optimizer) -> data -> plan -> executor -> metrics.

One ``Trainer`` per run: ``setup()`` builds everything, ``train()`` is the loop over
``train_step(batch)``, and the output folder ends as an HF model folder (config, safetensors,
tokenizer) plus the resolved LazyTrain config, the prompt template and ``metrics.jsonl``.
Checkpoints under ``checkpoints/`` hold what ``training.resume=true`` needs to continue exactly
where the run stopped (`lazytrain.train.checkpoint`); SIGINT / SIGTERM stop the run after the
current step with a checkpoint (`lazytrain.train.signals`).

Launched by ``torchrun`` (one process per GPU) the same recipe runs data parallel: each rank
trains on its rows of every global batch with the host state sharded (``memory.shard``,
``runtime.distributed``); rank 0 alone writes logs, metrics and the model folder, and every
rank writes its shard of each checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from lazytrain.config import Config, ConfigError
from lazytrain.data.dataset import Batch
from lazytrain.data.pipeline import heldout_samples, resolve_template, training_batches
from lazytrain.model.loading import save_hf
from lazytrain.plan.plan import Plan
from lazytrain.plan.planner import OutOfGpuMemory
from lazytrain.runtime.device import oom_need_bytes, release_failed_step
from lazytrain.runtime.executor import Executor, host_grad_groups
from lazytrain.runtime.update import HostUpdater
from lazytrain.train.checkpoint import Checkpointer, check_output_dir, gb
from lazytrain.train.divergence import SkipCounter
from lazytrain.train.metrics import MetricsWriter, step_metrics, truncate_metrics
from lazytrain.train.schedule import learning_rate
from lazytrain.train.session import build_session, check_inputs
from lazytrain.train.signals import StopRequest, TrainingInterrupted

if TYPE_CHECKING:
    from lazytrain.plan.costs import CostTable

log = logging.getLogger(__name__)

__all__ = ["OutOfGpuMemory", "Trainer"]  # the run's error when no smaller plan fits, the planner's


class Trainer:
    """Full-parameter SFT of a streamed model.

    Raises at setup for: an unsupported architecture or a missing model folder, an output
    folder holding another run, host memory or disk space that cannot hold the run (with the
    bytes), data that is empty after truncation, and a plan that does not match the model.
    """

    def __init__(self, config: Config):
        self.config = config
        tc = config.training
        self.out_dir = Path(tc.output_dir)
        self.step = 0
        self.skips = SkipCounter(tc.max_skipped_steps)
        self.checkpointer = Checkpointer(self.out_dir, keep=tc.keep_checkpoints, in_place=tc.checkpoint_in_place)

    # -- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg, tc = self.config, self.config.training
        check_inputs(cfg)  # before the output folder: its state must not hide a missing model or data file
        check_output_dir(self.out_dir, tc.resume, tc.overwrite)
        resume_from = self.checkpointer.resume_point() if tc.resume else None
        self.session = session = build_session(cfg)
        self.device, self.dtype, self.tokenizer = session.device, session.dtype, session.tokenizer
        self.adapter, self.store, self.optimizer = session.adapter, session.store, session.optimizer
        self.parallel = session.parallel
        self.is_main = self.parallel is None or self.parallel.info.is_main
        if self.parallel is not None:  # every rank writes its shard of each checkpoint
            self.checkpointer.shard(self.parallel.info.rank, self.parallel.info.world_size, self.parallel.all_agree)
        if not self.is_main:
            logging.getLogger("lazytrain").setLevel(logging.WARNING)  # rank 0 logs
        self.template = resolve_template(cfg.data)
        self.batches, self.data_report = training_batches(
            cfg.data, self.tokenizer, self.template, batch_size=tc.batch_size, seed=tc.seed,
            pad_to_multiple_of=8 if self.device.type == "cuda" else 1,
        )
        self.planner = session.planner
        session.plan()
        self._start_plan()
        self.checkpoint_bytes = self.checkpointer.size_bytes(self.store.masters, self.optimizer.state_dict())
        if resume_from is None and tc.overwrite and self.is_main:
            self.checkpointer.remove_all()
        # the model export is bf16 (or fp32 on an fp32 run) of every parameter
        export_bytes = self.store.num_params * self.dtype.itemsize
        self.checkpointer.check_room(self.checkpoint_bytes, extra=export_bytes, whole_run=True)
        if resume_from is not None:
            self._load_checkpoint(resume_from)
            if self.is_main:
                truncate_metrics(self.out_dir / "metrics.jsonl", self.step)
        self.metrics = MetricsWriter(self.out_dir, append=self.step > 0) if self.is_main else None
        if self.is_main:
            cfg.save(self.out_dir / "lazytrain_config.yaml")
            self.template.save(self.out_dir)

    @property
    def plan(self) -> Plan:
        """The running plan (the planner's)."""
        return self.planner.plan

    @property
    def costs(self) -> CostTable | None:
        """The cost table the running plan is predicted with (None: none), the planner's."""
        return self.planner.costs

    @property
    def predicted(self) -> dict[str, float]:
        """The planner's prediction for the running plan, logged beside the measured figures."""
        return self.planner.predicted

    def _start_plan(self) -> None:
        """Executor and CPU updater for the planner's plan."""
        session = self.session
        if self.planner.table:
            log.info("plan:\n%s", self.planner.table)
        if self.store.host_grad_groups is None:  # the first plan: no host buffer for what it holds on the GPU
            self.store.allocate_grads(host_grad_groups(self.plan, len(self.store.weights)))
            held = sorted(set(range(len(self.store.weights))) - self.store.host_grad_groups)
            self.planner.hold_gradients([g - 1 for g in held])  # later plans hold them too
            if held:
                log.info("gradients held on the GPU until the update (no host buffer): layers %s; their ring %s",
                         [g - 1 for g in held], gb(self.store.ring_bytes))
        host = session.host_memory(int(self.predicted.get("predicted_act_host_gb", 0.0) * 1e9), self.costs)
        log.info("host memory with the plan's activations:\n%s", host.table())
        # what a failed step of this plan may leave (`_release`) is counted from here
        self._allocated_at_plan_start = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.executor = Executor(self.adapter, self.store, self.plan, self.device, nvme=session.nvme,
                                 parallel=self.parallel)
        self.executor.trace.enabled = self.device.type == "cuda"
        self.updater = HostUpdater(self.executor, self.optimizer, overlap=self.config.plan.overlap_optimizer)

    def _drop_executor(self) -> None:
        """Finish the CPU update and let go of the executor (before another plan starts)."""
        self.updater.finish()
        self.executor.abandon()  # its buffers go even if something (a failed graph) still refers to it
        del self.executor, self.updater

    def _recalibrate(self) -> None:
        """Re-plan on the CPU update rate this plan's steps measured (`Planner.recalibrate`)."""
        _, notes = self.planner.recalibrate(self.updater.cpu_params)
        if notes.record:
            self._write({"step": self.step, **notes.record})
        if notes.message:
            log.info("%s", notes.message)
        if notes.changed:
            self._drop_executor()
            self._start_plan()

    def _release(self, error: torch.OutOfMemoryError) -> int | None:
        """Drop the executor (its update finished first) and what ``error`` still holds; the
        GPU bytes still allocated beyond what the plan started with (None on the CPU)."""
        self._drop_executor()
        release_failed_step(error)  # the failed step's frames hold the old executor's GPU memory
        if self.device.type != "cuda":
            return None
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device) - self._allocated_at_plan_start

    def _replan_after_oom(self, error: torch.OutOfMemoryError) -> None:
        """Run the step again on the plan the planner re-solves with less GPU memory
        (`Planner.after_oom`), or raise `OutOfGpuMemory`. The need is read before the failed
        executor is dropped (it reads the allocator's peak)."""
        need = oom_need_bytes(error, self.device)
        _, notes = self.planner.after_oom(need, str(error).splitlines()[0], release=lambda: self._release(error))
        log.warning("step %d ran out of GPU memory: %s and running the step again", self.step + 1, notes.message)
        self._start_plan()

    def _after_update_oom(self) -> None:
        """The GPU ran out of memory for an optimizer step planned there (`HostUpdater`): those
        groups were stepped on the CPU instead, the same update, and stay there while this plan
        runs; the planner re-solves a solved plan with less GPU memory (`Planner.after_update_oom`;
        the step is not run again: it is done), any other goes on as it is."""
        error, self.updater.out_of_memory = self.updater.out_of_memory, None
        _, notes = self.planner.after_update_oom(oom_need_bytes(error, self.device), before_solve=self.updater.finish)
        if not notes.changed:
            log.warning("an optimizer step planned on the GPU ran out of its memory (found after step %d) and went "
                        "to the CPU; %s", self.step, notes.message)
            return
        log.warning("an optimizer step planned on the GPU ran out of its memory (found after step %d): %s",
                    self.step, notes.message)
        self._release(error)
        self._start_plan()

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> dict:
        tc = self.config.training
        bar = tqdm(total=tc.steps, initial=self.step, disable=not (tc.progress and self.is_main), desc="train",
                   dynamic_ncols=True)
        record = None
        self._step_start = self.last_save_time = time.perf_counter()
        with StopRequest() as stop:
            while self.step < tc.steps and stop.signum is None:
                batch = next(self.batches)
                record = self.train_step(self.parallel.local_rows(batch) if self.parallel is not None else batch)
                self._write(record)
                if record["skipped"]:
                    self._on_skip(record)
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4f}", gnorm=f"{record['grad_norm']:.2f}",
                                tok_s=f"{record['tokens_per_s']:.0f}")
                if tc.log_every and self.step % tc.log_every == 0 and not tc.progress and self.is_main:
                    log.info("step %d loss %.4f grad_norm %.3f %.0f tok/s", self.step, record["loss"],
                             record["grad_norm"], record["tokens_per_s"])
                if self.step < tc.steps and stop.signum is None and self._checkpoint_due():
                    self.save_checkpoint()
                if self.step < tc.steps and tc.eval_every and self.step % tc.eval_every == 0 and self.is_main:
                    self._write({"step": self.step, **self.evaluate()})
            bar.close()
            if stop.signum is not None and self.step < tc.steps:
                self.save_checkpoint()
                self._close()
                raise TrainingInterrupted(
                    f"stopped by {stop.name} after step {self.step} of {tc.steps}; checkpoint written "
                    f"to {self.checkpointer.latest().path}. Resume with:\n  lazytrain train "
                    f"{self.out_dir / 'lazytrain_config.yaml'} training.resume=true",
                    stop.signum,
                )
            self.updater.finish()  # the last step's CPU update
            if self.is_main:
                self.save_model(self.out_dir)
            self.save_checkpoint()
        final_eval = None
        if self.is_main and self.config.data.dataset == "builtin":
            final_eval = self.evaluate()
            self._write({"step": self.step, **final_eval})
        self._close()
        return {"steps": self.step, "skipped_steps": self.skips.total, "last": record, "eval": final_eval}

    def train_step(self, batch: Batch) -> dict:
        """Forward + backward of ``batch``, then the (overlapped) CPU update; the step's metrics.

        A step with a non-finite loss or gradient touches no state and is recorded as skipped.
        """
        tc, oc = self.config.training, self.config.optimizer
        while True:
            try:
                stats = self.executor.forward_backward(batch.input_ids, batch.labels, batch.attention_mask,
                                                       position_ids=batch.position_ids,
                                                       document_ids=batch.document_ids)
                break
            except torch.OutOfMemoryError as error:
                self._replan_after_oom(error)
        trace = self.executor.trace.summary()
        waited = self.updater.wait_seconds  # this forward waiting for the last CPU update
        lr = learning_rate(self.step, tc.steps, oc.lr, oc.warmup_steps, oc.schedule, oc.min_lr_ratio)
        skipped = not (math.isfinite(stats.grad_norm) and math.isfinite(stats.loss))
        self.skips.update(skipped)
        if not skipped:
            clip = 1.0
            if tc.max_grad_norm > 0:
                clip = min(1.0, tc.max_grad_norm / (stats.grad_norm + 1e-6))
            self.updater.start(clip, lr)
            if self.updater.last_step_seconds > 0:  # the last finished update (the step before's, overlapped)
                self.planner.timed_update(self.updater.last_step_seconds)
        self.step += 1
        now = time.perf_counter()
        step_time, self._step_start = now - self._step_start, now
        seq = int(batch.input_ids.shape[1])
        record = {
            "step": self.step, "loss": stats.loss, "grad_norm": stats.grad_norm, "lr": lr, "skipped": skipped,
            "tokens": stats.num_tokens, "target_tokens": stats.num_target_tokens, "seq_len": seq,
            "batch_size": int(batch.input_ids.shape[0]) * (self.parallel.world_size if self.parallel else 1),
            **step_metrics(self.adapter, stats, trace, step_time, seq, self.device),
            **self.predicted,
            "optimizer_wait_s": waited,
        }
        if self.updater.out_of_memory is not None:  # this update, or the forward before it
            self._after_update_oom()
            self._step_start = time.perf_counter()  # the re-solve is not the next step's time
        if self.planner.recalibration_due():
            self._recalibrate()
            self._step_start = time.perf_counter()  # the re-solve is not the next step's time
        return record

    def _on_skip(self, record: dict) -> None:
        if self.skips.diverged:  # stop cleanly: the last checkpoint stays the last good state
            self.updater.finish()
            self._close()
        latest = self.checkpointer.latest()
        self.skips.report(record, self.config.optimizer.lr, self.config.training.max_grad_norm,
                          f"{latest.path} (step {latest.step})" if latest else None)

    def _write(self, record: dict) -> None:
        if self.metrics is not None:  # rank 0 alone writes metrics
            self.metrics.write(record)

    def _close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.parallel is not None:
            self.parallel.close()

    def _checkpoint_due(self) -> bool:
        tc = self.config.training
        if self.skips.in_a_row:  # the last checkpoint stays the last good state
            return False
        if tc.save_every and self.step % tc.save_every == 0:
            return True
        minutes = (time.perf_counter() - self.last_save_time) / 60
        return bool(tc.save_every_minutes) and minutes >= tc.save_every_minutes

    def evaluate(self, tier: str | None = None, seed: int | None = None) -> dict:
        """Exact match on the built-in held-out split (of ``tier`` and drawn with ``seed``;
        default: the tier and seed trained with), generating with the weights in the host store."""
        from lazytrain.eval.evaluate import streamed_exact_match

        self.updater.finish()
        data = self.config.data if tier is None else dataclasses.replace(self.config.data, builtin_tier=tier)
        samples = heldout_samples(data, self.config.training.seed if seed is None else seed)
        report = streamed_exact_match(self.adapter, self.store, self.tokenizer, self.template, samples)
        return {"eval_exact_match": report["accuracy"], "eval_no_answer": report["no_answer"],
                "eval_samples": report["n"]}

    # -- outputs ----------------------------------------------------------------------------

    def save_model(self, out_dir: Path) -> None:
        """An HF model folder: config, safetensors (bf16), tokenizer, prompt template."""
        self.updater.finish()
        # data parallel: the masters are shards; the shared weights hold all of them, rounded
        # to the model dtype, which is what is written
        save_hf(self.adapter, self.store, out_dir,
                dtype=torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32,
                groups=self.store.weights if self.parallel is not None else None)
        self.tokenizer.save_pretrained(out_dir)
        self.template.save(out_dir)

    def save_checkpoint(self) -> None:
        """Masters, optimizer state, data position and step: what resume needs (data parallel:
        every rank its shards, rank 0 the step and data position)."""
        self.updater.finish()
        started = time.perf_counter()
        path = self.checkpointer.save(self.step, self.store.masters, self.optimizer.state_dict(), {
            "skipped_steps": self.skips.total, "data": self.batches.state_dict(),
            "num_params": self.store.num_params,
        })
        self.last_save_time = time.perf_counter()
        log.info("checkpoint %s: %s in %.1f s", path, gb(self.checkpoint_bytes), self.last_save_time - started)

    def _load_checkpoint(self, found) -> None:
        state = found.state
        optimizer_state = self.checkpointer.restore(found, self.store.masters, self.store.num_params)
        for g in range(len(self.store.masters)):
            self.store.sync_weights_from_masters(g)
            if self.parallel is not None:
                self.parallel.publish(self.store, g)  # the other ranks' shards of the weights
            self.executor.weights_updated(g)
        try:
            self.optimizer.load_state_dict(optimizer_state)
        except ValueError as error:  # another optimizer.kind, or another model's groups: the user's to fix
            raise ConfigError(f"training.resume=true: the checkpoint {found.path} does not fit this run: "
                              f"{error}") from error
        self.batches.load_state_dict(state["data"])
        self.step = state["step"]
        self.skips.total = state["skipped_steps"]
        log.info("resumed from %s at step %d", found.path, self.step)
