"""The SFT recipe: config -> session (model, optimizer) -> data -> plan -> executor -> metrics.

One ``Trainer`` per run: ``setup()`` builds everything, ``train()`` is the loop over
``train_step(batch)``, and the output folder ends as an HF model folder (config, safetensors,
tokenizer) plus the resolved LazyTrain config, the prompt template and ``metrics.jsonl``. A
``checkpoint/`` folder in it holds what ``training.resume=true`` needs to continue exactly
where the run stopped.

Launched by ``torchrun`` (one process per GPU) the same recipe runs data parallel: each rank
trains on its rows of every global batch with the host state sharded (``memory.shard``,
``runtime.distributed``); rank 0 alone writes logs, metrics and the model folder, and every
rank writes its shard of the checkpoint (``train.shard_checkpoint``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from lazytrain.config import Config
from lazytrain.data.dataset import Batch
from lazytrain.data.pipeline import heldout_samples, resolve_template, training_batches
from lazytrain.model.loading import save_hf
from lazytrain.plan.simulate import simulate
from lazytrain.runtime.executor import Executor
from lazytrain.runtime.update import HostUpdater
from lazytrain.train.metrics import MetricsWriter, step_metrics
from lazytrain.train.schedule import learning_rate
from lazytrain.train.session import build_session
from lazytrain.train.shard_checkpoint import CheckpointError, check_world_size, shard_file_names

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "Trainer"]


class Trainer:
    """Full-parameter SFT of a streamed model.

    Raises at setup for: an unsupported architecture or a missing model folder, host memory
    that cannot hold the model (with the bytes), data that is empty after truncation, and a
    plan that does not match the model's layer count.
    """

    def __init__(self, config: Config):
        self.config = config
        self.out_dir = Path(config.training.output_dir)
        self.step = 0
        self.skipped_steps = 0

    # -- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.config
        self.session = session = build_session(cfg)
        self.device, self.dtype, self.tokenizer = session.device, session.dtype, session.tokenizer
        self.adapter, self.store, self.optimizer = session.adapter, session.store, session.optimizer
        self.parallel = session.parallel
        self.is_main = self.parallel is None or self.parallel.info.is_main
        if not self.is_main:
            logging.getLogger("lazytrain").setLevel(logging.WARNING)  # rank 0 logs
        self.template = resolve_template(cfg.data)
        self.batches, self.data_report = training_batches(
            cfg.data, self.tokenizer, self.template, batch_size=cfg.training.batch_size, seed=cfg.training.seed,
            pad_to_multiple_of=8 if self.device.type == "cuda" else 1,
        )
        self.plan, self.costs = session.plan()
        # what the planner predicts for this plan, logged beside the measured figures each step
        self.predicted = (
            simulate(self.plan, self.costs, optimizer_overlap=cfg.plan.overlap_optimizer).metrics()
            if self.costs is not None else {"predicted_step_time_s": self.plan.predicted_step_time_s}
        )
        self.executor = Executor(self.adapter, self.store, self.plan, self.device, nvme=session.nvme,
                                 parallel=self.parallel)
        self.executor.trace.enabled = self.device.type == "cuda"
        self.updater = HostUpdater(self.executor, self.optimizer, overlap=cfg.plan.overlap_optimizer)
        if cfg.training.resume and (self.out_dir / "checkpoint").exists():
            self._load_checkpoint(self.out_dir / "checkpoint")
        self.metrics = MetricsWriter(self.out_dir, append=self.step > 0) if self.is_main else None
        if self.is_main:
            cfg.save(self.out_dir / "lazytrain_config.yaml")
            self.template.save(self.out_dir)

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> dict:
        tc = self.config.training
        bar = tqdm(total=tc.steps, initial=self.step, disable=not (tc.progress and self.is_main), desc="train",
                   dynamic_ncols=True)
        record = None
        self._step_start = time.perf_counter()
        while self.step < tc.steps:
            batch = next(self.batches)
            record = self.train_step(self.parallel.local_rows(batch) if self.parallel is not None else batch)
            if self.is_main:
                self.metrics.write(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", gnorm=f"{record['grad_norm']:.2f}",
                            tok_s=f"{record['tokens_per_s']:.0f}")
            if tc.log_every and self.step % tc.log_every == 0 and not tc.progress and self.is_main:
                log.info("step %d loss %.4f grad_norm %.3f %.0f tok/s", self.step, record["loss"],
                         record["grad_norm"], record["tokens_per_s"])
            if self.step < tc.steps and tc.save_every and self.step % tc.save_every == 0:
                self.save_checkpoint()
            if self.step < tc.steps and tc.eval_every and self.step % tc.eval_every == 0 and self.is_main:
                self.metrics.write({"step": self.step, **self.evaluate()})
        bar.close()
        self.updater.finish()
        if self.is_main:
            self.save_model(self.out_dir)
        self.save_checkpoint()
        final_eval = None
        if self.is_main and self.config.data.dataset == "builtin":
            final_eval = self.evaluate()
            self.metrics.write({"step": self.step, **final_eval})
        if self.is_main:
            self.metrics.close()
        if self.parallel is not None:
            self.parallel.close()
        return {"steps": self.step, "skipped_steps": self.skipped_steps, "last": record, "eval": final_eval}

    def train_step(self, batch: Batch) -> dict:
        """Forward + backward of ``batch``, then the (overlapped) CPU update; the step's metrics."""
        tc, oc = self.config.training, self.config.optimizer
        stats = self.executor.forward_backward(batch.input_ids, batch.labels, batch.attention_mask)
        trace = self.executor.trace.summary()
        waited = self.updater.wait_seconds  # this forward waiting for the last CPU update
        lr = learning_rate(self.step, tc.steps, oc.lr, oc.warmup_steps, oc.schedule, oc.min_lr_ratio)
        skipped = not (math.isfinite(stats.grad_norm) and math.isfinite(stats.loss))
        if skipped:
            # a non-finite gradient: no state is touched, the step is counted and logged
            self.skipped_steps += 1
        else:
            clip = 1.0
            if tc.max_grad_norm > 0:
                clip = min(1.0, tc.max_grad_norm / (stats.grad_norm + 1e-6))
            self.updater.start(clip, lr)
        self.step += 1
        now = time.perf_counter()
        step_time, self._step_start = now - self._step_start, now
        return {
            "step": self.step,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "lr": lr,
            "skipped": skipped,
            "tokens": stats.num_tokens,
            "target_tokens": stats.num_target_tokens,
            "batch_size": int(batch.input_ids.shape[0]) * (self.parallel.world_size if self.parallel else 1),
            "seq_len": int(batch.input_ids.shape[1]),
            **step_metrics(self.adapter, stats, trace, step_time, int(batch.input_ids.shape[1]), self.device),
            **self.predicted,
            "optimizer_wait_s": waited,
        }

    def evaluate(self) -> dict:
        """Exact match on the built-in held-out split, generating with the weights in the host store."""
        from lazytrain.eval.evaluate import streamed_exact_match

        self.updater.finish()
        samples = heldout_samples(self.config.data, self.config.training.seed)
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

    def _rank_world(self) -> tuple[int, int]:
        return (self.parallel.rank, self.parallel.world_size) if self.parallel is not None else (0, 1)

    def save_checkpoint(self) -> None:
        """Masters, optimizer state, data position and step: what resume needs. Data
        parallel: every rank writes its shards, rank 0 the step and data position."""
        self.updater.finish()
        ckpt = self.out_dir / "checkpoint"
        tmp = self.out_dir / "checkpoint.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        rank, world = self._rank_world()
        masters_name, optimizer_name = shard_file_names(rank, world)
        save_file({f"g{g}": m.contiguous() for g, m in enumerate(self.store.masters)}, str(tmp / masters_name))
        torch.save(self.optimizer.state_dict(), tmp / optimizer_name)
        if self.is_main:
            (tmp / "state.json").write_text(json.dumps({
                "step": self.step,
                "skipped_steps": self.skipped_steps,
                "data": self.batches.state_dict(),
                "num_params": self.store.num_params,
                "world_size": world,
            }))
        if self.parallel is not None:
            self.parallel.barrier()  # every shard is written
        if self.is_main:
            if ckpt.exists():
                for f in ckpt.iterdir():
                    f.unlink()
                ckpt.rmdir()
            tmp.rename(ckpt)
        if self.parallel is not None:
            self.parallel.barrier()

    def _load_checkpoint(self, ckpt: Path) -> None:
        state = json.loads((ckpt / "state.json").read_text())
        if state["num_params"] != self.store.num_params:
            raise CheckpointError(
                f"checkpoint {ckpt} is of a model with {state['num_params']} parameters, this "
                f"model has {self.store.num_params}; use another training.output_dir"
            )
        rank, world = self._rank_world()
        check_world_size(state, world, ckpt)
        masters_name, optimizer_name = shard_file_names(rank, world)
        masters = load_file(str(ckpt / masters_name))
        for g, m in enumerate(self.store.masters):
            m.copy_(masters[f"g{g}"])
            self.store.sync_weights_from_masters(g)
            if self.parallel is not None:
                self.parallel.publish(self.store, g)  # the other ranks' shards of the weights
            self.executor.weights_updated(g)
        self.optimizer.load_state_dict(torch.load(ckpt / optimizer_name, weights_only=False))
        self.batches.load_state_dict(state["data"])
        self.step = state["step"]
        self.skipped_steps = state["skipped_steps"]
