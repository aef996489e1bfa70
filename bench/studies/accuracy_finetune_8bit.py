"""8-bit optimizer states when fine-tuning: pretrain from scratch, then fine-tune at lr 1e-5.

Per seed: train a built-in shape from scratch on one built-in tier with fp32 states, then
fine-tune that model on another tier at a fine-tuning learning rate with each optimizer kind
(``bench/studies/optim_convergence.py``'s kinds: ``fp32``; the nulls, the same fp32 AdamW math with
other float rounding: ``fp32_kernel`` (LazyTrain's fused kernel with fp32 states for every
group; on the H200, 301-353 s per 0.5B fine-tune against 238-254 s for torch's fused fp32, two
or three runs sharing the host) and ``fp32_unfused`` (torch's single-tensor loop, 2-3x fp32's
time, not run unless asked for); ``hybrid8bit``; ``hybrid8bit_sr``, its sqrt(v) rounded
stochastically (``optimizer.state_rounding``), not run unless asked for). One record per (kind, seed) with the
fine-tuning loss curve, held-out exact match on the fine-tuning tier and, after the fine-tune,
on the pretraining tier (``retained_exact_match``, the same held-out problems the base was
scored on: the base's skill after the fine-tune, an exact match that can move where the new
tier's is still near zero after 300 steps at lr 1e-5) and, before the fine-tune, the base's on
the fine-tuning tier (``base_exact_match``). ``--finetune-tier addsub2`` (add2's place-value
form, half subtractions) keeps the base's format: on the H200, ``addsub`` (seed 3) left 2.5%
and ``mul`` 0% of add2's exact match after 300 steps. The report gives 8-bit's and the null's
deviation from fp32 along the loss curve, tail loss and exact match against fp32 with 90%
intervals from resampling the seeds.

    python -m bench.studies.accuracy_finetune_8bit --shape qwen2.5-0.5b --seeds 1 2 3     # the H200 study
    python -m bench.studies.accuracy_finetune_8bit --shape tiny --pretrain-steps 5 --finetune-steps 5 --heldout 4

``--jobs N``: the shared pretraining runs in a process of its own, then each (kind, seed)
fine-tune in its own process, N at once on the one device with ``cores // N`` CPU threads
each, each writing its record file as it finishes; what finished (by ``--time-limit``) is
merged into one record file + report and the per-run files and logs are packed into one
archive. The runs go seed by seed, each seed's kinds together, ``fp32_unfused`` (when asked
for) after all of them: the CPU step (host memory bandwidth, not the GPU) bounds these runs,
and that null's is two to three times fp32's (torch's single-tensor loop makes several passes).

    python -m bench.studies.accuracy_finetune_8bit --shape qwen2.5-0.5b --seeds 1 2 3 4 5 --jobs 3 --time-limit 480
    python -m bench.studies.accuracy_finetune_8bit --merge RUNS/*.json --tag _h200    # what a cut-off run left
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from bench.common import RESULTS, child_env, run_header, today, write_results
from bench.studies.optim_convergence import run
from bench.studies.optim_convergence_seeds import interval, points, ratio
from lazytrain.runtime.device import resolve_device

KINDS = ("fp32", "fp32_kernel", "fp32_unfused", "hybrid8bit", "hybrid8bit_sr", "hybrid8bit_bf16master", "hybrid4bit",
         "hybrid4bit_bf16master", "hybrid4bit_sr", "hybrid4bit_sr_bf16master")
DEFAULT_KINDS = ("fp32", "fp32_kernel", "hybrid8bit")
STUDY_OPTIONS = ("shape", "dtype", "pretrain_tier", "pretrain_steps", "pretrain_lr", "pretrain_runner", "pretrain_seed",
                 "finetune_tier", "finetune_steps", "finetune_lr", "batch_size", "heldout", "tail", "device")
"""The options that define the study: every process of a ``--jobs`` run is given them."""
PRETRAIN_SETTINGS = ("shape", "dtype", "pretrain_tier", "pretrain_steps", "pretrain_lr", "batch_size", "heldout",
                     "pretrain_runner")
"""What a reused pretraining must have been made with."""


def study(args: argparse.Namespace) -> list[dict]:
    device = resolve_device(args.device)
    common = [f"model.source=builtin:{args.shape}", f"training.device={args.device}",
              f"data.heldout_size={args.heldout}", f"training.batch_size={args.batch_size}",
              f"model.dtype={args.dtype}"]
    records = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        shared = Path(args.pretrained or tmp)
        if args.pretrain_only:
            pretrain(args, common, shared, args.pretrain_seed)
            return []
        for seed in args.seeds:
            records += finetune_seed(args, common, device, seed, shared)
    return records


def pretrain(args: argparse.Namespace, common: list[str], folder: Path, seed: int) -> dict:
    """Train from scratch with fp32 states into ``folder/pretrained``, or reuse the pretraining
    there (``folder/pretrained.json``: its settings, seed, exact match and seconds)."""
    meta = folder / "pretrained.json"
    settings = {name: getattr(args, name) for name in PRETRAIN_SETTINGS}
    if meta.exists():
        base = json.loads(meta.read_text())
        if {"pretrain_runner": "lazytrain", "dtype": "auto", **base["settings"]} != settings:
            raise SystemExit(f"{meta}: pretrained with {base['settings']}, this study asks for {settings}; "
                             "give another --pretrained folder")
        if base["seed"] != seed:
            raise SystemExit(f"{meta}: pretrained with seed {base['seed']}, this study asks for --pretrain-seed "
                             f"{seed}; give --pretrain-seed {base['seed']} or another --pretrained folder")
        return base
    overrides = (*common, f"data.builtin_tier={args.pretrain_tier}", f"optimizer.lr={args.pretrain_lr}")
    if args.pretrain_runner == "torch":
        result = pretrain_torch(args.pretrain_steps, folder / "pretrained", seed, overrides)
    else:
        result = run("fp32", args.pretrain_steps, folder / "pretrained", seed, overrides)
    base = {"settings": settings, "seed": seed, "exact_match": result["exact_match"], "seconds": result["seconds"],
            "weights_sha256": weights_digest(folder / "pretrained")}
    meta.write_text(json.dumps(base))
    return base


def pretrain_torch(steps: int, out_dir: Path, seed: int, overrides: tuple[str, ...]) -> dict:
    """The pretraining through plain PyTorch on the device (`bench.studies.accuracy_reference`: the HF
    model, torch AdamW there, bf16 autocast on a GPU, fp32 on the CPU), saved where `run` would
    have saved LazyTrain's: on the H200 this takes a fraction of LazyTrain's 375 s, whose CPU
    AdamW over 0.5B parameters (not under study in the pretraining) bounds each step."""
    from bench.studies.accuracy_reference import train_torch
    from lazytrain.config import load_config

    start = time.perf_counter()
    cfg = load_config(None, [f"training.steps={steps}", f"training.seed={seed}", "training.progress=false",
                             f"training.output_dir={out_dir}", *overrides])
    cuda = resolve_device(cfg.training.device).type == "cuda"
    trained = train_torch("torch_autocast_bf16" if cuda else "torch_fp32", cfg)
    exact = trained.exact_match()
    trained.save(out_dir, torch.bfloat16 if cuda else torch.float32)
    return {"exact_match": exact, "seconds": time.perf_counter() - start}


def weights_digest(model_dir: Path) -> str:
    """SHA-256 over a saved model's safetensors files, in name order: studies merged across
    sessions (each pretrains anew on a fresh machine) check that their seeds share one base."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def finetune_seed(args: argparse.Namespace, common: list[str], device, seed: int, shared: Path) -> list[dict]:
    """Pretrain (once for all seeds with ``--shared-pretrain``), then fine-tune with each kind."""
    records = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        folder = shared if args.shared_pretrain else Path(tmp)
        base = pretrain(args, common, folder, args.pretrain_seed if args.shared_pretrain else seed)
        for kind in args.kinds:
            result = run(kind, args.finetune_steps, Path(tmp) / kind, seed, (
                *common, f"model.source={folder / 'pretrained'}", f"data.builtin_tier={args.finetune_tier}",
                f"optimizer.lr={args.finetune_lr}", "optimizer.weight_decay=0.0"),
                also_eval=(args.pretrain_tier, base["seed"]), eval_first=True)
            losses = result["losses"]
            records.append({
                "name": f"finetune_8bit_{args.shape}", **run_header(device), "model": f"builtin:{args.shape}",
                "runner": "lazytrain", "kind": kind, "seed": seed, "precision": "bf16" if device.type == "cuda"
                else "fp32", "optimizer": "adamw_hybrid8bit" if kind.startswith("hybrid8bit") else "adamw_fp32",
                "optimizer_backend": result["optimizer_backend"],
                "pretrain_tier": args.pretrain_tier, "pretrain_steps": args.pretrain_steps,
                "pretrain_seed": base["seed"], "pretrain_exact_match": base["exact_match"],
                "pretrain_weights_sha256": base.get("weights_sha256"),
                "pretrain_runner": base["settings"].get("pretrain_runner", "lazytrain"),
                "finetune_tier": args.finetune_tier,
                "finetune_steps": args.finetune_steps, "lr": args.finetune_lr, "batch_size": args.batch_size,
                "heldout": args.heldout, "base_exact_match": result["first_exact_match"],
                "exact_match": result["exact_match"], "no_answer": result["no_answer"],
                "retained_exact_match": result["also_exact_match"],
                "retained_eval_seconds": result["also_eval_seconds"],
                "tail_loss": statistics.fmean(losses[-args.tail:]), "loss_every_10_steps": losses[::10],
                "seconds": result["seconds"], "shared_pretrain": args.shared_pretrain,
            })
    return records


@dataclasses.dataclass(eq=False)
class Job:
    """One process of a ``--jobs`` run (``threads``: its OMP_NUM_THREADS); ``kind`` groups jobs
    of about the same duration."""

    name: str
    kind: str
    argv: list[str]
    threads: int


def run_jobs(jobs: list[Job], at_once: int, logs: Path, deadline: float,
             expected: dict[str, float] | None = None) -> dict[str, str]:
    """Run ``jobs`` in order, ``at_once`` at a time, each with its CPU threads and its log in
    ``logs``; at ``deadline`` (``time.monotonic``) the running ones are killed. A job is not
    started when less time is left than the quickest finished job of its kind took, or of any
    kind while none of its kind has finished (it would only take CPU from the runs that can
    finish); ``expected`` (seconds by kind, from an earlier study) counts as one finished job
    of that kind. Each job's outcome, by name."""
    pending, running, outcome = list(jobs), {}, {}
    took = {kind: [seconds] for kind, seconds in (expected or {}).items()}

    def settle(job: Job, what: str) -> None:
        outcome[job.name] = what
        print(f"{time.strftime('%H:%M:%S')} {job.name}: {what}", flush=True)

    while pending or running:
        for job, (proc, started, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                del running[job]
                seconds = time.monotonic() - started
                if proc.returncode == 0:
                    took.setdefault(job.kind, []).append(seconds)
                    settle(job, f"finished in {seconds:.0f} s")
                else:
                    settle(job, f"failed (exit {proc.returncode}, see {job.name}.log)")
        now = time.monotonic()
        if now >= deadline:
            for job, (proc, _, log) in running.items():
                proc.kill()
                proc.wait()
                log.close()
                settle(job, "stopped at the time limit")
            break
        while pending and len(running) < at_once:
            job = pending.pop(0)
            # a kind not seen finishing yet takes at least as long as the quickest run seen
            known = took.get(job.kind) or [t for times in took.values() for t in times]
            quickest = min(known, default=0.0)
            if deadline - now < quickest:
                settle(job, f"not started: {deadline - now:.0f} s left, the quickest run (or --expect) took {quickest:.0f} s")
                continue
            log = open(logs / f"{job.name}.log", "w")  # noqa: SIM115 (closed when the run ends)
            env = child_env(OMP_NUM_THREADS=str(job.threads), PYTHONUNBUFFERED="1")  # a killed run keeps its log
            running[job] = (subprocess.Popen(job.argv, stdout=log, stderr=subprocess.STDOUT, env=env), now, log)
            print(f"{time.strftime('%H:%M:%S')} {job.name}: started ({job.threads} threads)", flush=True)
        time.sleep(0.5)
    for job in pending:
        settle(job, "not started: time limit")
    return outcome


def parallel_study(args: argparse.Namespace) -> Path | None:
    """``--jobs``: the shared pretraining, then one process per (kind, seed); what finished is
    merged into one record file + report in ``--out``, the per-run files and logs packed into
    ``STEM_runs.tgz`` there. The merged record file, or None when nothing finished."""
    deadline = time.monotonic() + args.time_limit if args.time_limit else float("inf")
    stem = f"finetune_8bit_{args.shape}_{today()}{args.tag}"
    out = Path(args.out)
    runs = out / f"{stem}_runs"
    runs.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // args.jobs)
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        shared = args.pretrained or tmp
        script = [sys.executable, "-m", "bench.studies.accuracy_finetune_8bit", *study_arguments(args), "--pretrained", shared,
                  *(["--scratch", args.scratch] if args.scratch else [])]
        pretrain_threads = args.pretrain_threads or cores
        first = [Job("pretrain", "pretrain", [*script, "--pretrain-only",
                                              "--threads", str(pretrain_threads)], pretrain_threads)]
        if any(k.startswith("hybrid8bit") for k in args.kinds):  # built once now, not by the 8-bit runs racing for it
            build = "from lazytrain.optim.kernel import load_kernel; load_kernel(required=True)"
            first.append(Job("kernel_build", "kernel_build", [sys.executable, "-c", build], 1))
        before = run_jobs(first, len(first), runs, deadline)
        if not (Path(shared) / "pretrained.json").exists():
            print(f"the pretraining did not finish ({before['pretrain']}): no fine-tuning", flush=True)
            outcome = {f"{k}_s{s}": "not started: no pretraining" for k, s in runs_of(args)}
        else:
            order = runs_of(args)
            jobs = [Job(f"{k}_s{s}", k, [*script, "--kinds", k, "--seeds", str(s), "--out", str(runs),
                                         "--tag", f"_{k}_s{s}", "--threads", str(threads)], threads)
                    for k, s in order]
            outcome = run_jobs(jobs, args.jobs, runs, deadline, dict(args.expect))
        pretrained = json.loads((Path(shared) / "pretrained.json").read_text()) \
            if (Path(shared) / "pretrained.json").exists() else None
    files = sorted(runs.glob(f"finetune_8bit_{args.shape}_*.json"))
    notes = [f"{args.jobs} fine-tunes at once, {threads} of {cores} CPU threads each"
             + (f"; time limit {args.time_limit:.0f} s" if args.time_limit else "") + "."]
    if pretrained:
        notes.append(f"Pretraining (seed {pretrained['seed']}): {pretrained['seconds']:.0f} s, "
                     f"exact match {pretrained['exact_match']:.3f}.")
    if not before.get("kernel_build", "finished").startswith("finished"):
        notes.append(f"The 8-bit kernel build {before['kernel_build']} (records say each run's optimizer backend).")
    missing = {name: why for name, why in outcome.items() if not why.startswith("finished")}
    if missing:
        notes.append("Without a record: " + "; ".join(f"{name} ({why})" for name, why in missing.items()) + ".")
    path = merge(files, stem, command_line(args), out, notes) if files else None
    with tarfile.open(out / f"{stem}_runs.tgz", "w:gz") as tar:
        tar.add(runs, arcname=runs.name)
    shutil.rmtree(runs)
    return path


def runs_of(args: argparse.Namespace) -> list[tuple[str, int]]:
    """The (kind, seed) fine-tunes of a ``--jobs`` study in the order they start: ``--runs`` as
    given, else seed by seed in ``--kinds`` order (``fp32_unfused``, the slowest, last)."""
    if args.runs:
        return list(args.runs)
    return sorted(((k, s) for s in args.seeds for k in args.kinds),
                  key=lambda ks: (ks[0] == "fp32_unfused", args.seeds.index(ks[1]), args.kinds.index(ks[0])))


def kind_seed(text: str) -> tuple[str, int]:
    """``KIND:SEED`` of ``--runs``."""
    kind, _, seed = text.partition(":")
    if kind not in KINDS or not seed.isdigit():
        raise argparse.ArgumentTypeError(f"--runs {text!r}: give KIND:SEED, KIND one of {', '.join(KINDS)} and SEED "
                                         "a non-negative integer (e.g. hybrid8bit:4)")
    return kind, int(seed)


def expectation(text: str) -> tuple[str, float]:
    """``KIND=SECONDS`` of ``--expect``."""
    kind, _, seconds = text.partition("=")
    try:
        value = float(seconds)
    except ValueError:
        value = -1.0
    if kind not in KINDS or not value > 0:
        raise argparse.ArgumentTypeError(f"--expect {text!r}: give KIND=SECONDS, KIND one of {', '.join(KINDS)} "
                                         "and SECONDS > 0 (e.g. hybrid8bit=150)")
    return kind, value


def study_arguments(args: argparse.Namespace) -> list[str]:
    return [item for name in STUDY_OPTIONS for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def command_line(args: argparse.Namespace) -> str:
    extra = [f"--jobs {args.jobs}"] if args.jobs else []
    extra += [f"--time-limit {args.time_limit:g}"] if args.time_limit else []
    extra += ["--expect " + " ".join(f"{k}={v:g}" for k, v in args.expect)] if args.expect else []
    which = [f"--runs {' '.join(f'{k}:{s}' for k, s in args.runs)}"] if args.runs else [
        f"--seeds {' '.join(map(str, args.seeds))}", f"--kinds {' '.join(args.kinds)}"]
    return " ".join(["python -m bench.studies.accuracy_finetune_8bit", *study_arguments(args), *which, *extra])


def merge(files: list[Path], stem: str, command: str, out: Path | str, notes: list[str] = ()) -> Path:
    """The records of ``files`` as one record file + report ``out/stem``."""
    records = [r for f in files for r in json.loads(Path(f).read_text())]
    records.sort(key=lambda r: (r["seed"], KINDS.index(r["kind"])))  # stable: a repeat stays after its first run
    text = report(records, command, notes)
    print(text)
    return write_results(records, stem, text, out)


def report(records: list[dict], command: str, notes: list[str] = ()) -> str:
    first = records[0]
    by_kind: dict[str, dict[int, dict]] = {}
    repeats = []  # the same kind and seed again (another call): compared with the first, not counted twice
    for r in records:
        runs = by_kind.setdefault(r["kind"], {})
        if r["seed"] in runs:
            repeats.append(r)
        else:
            runs[r["seed"]] = r
    bases = {r.get("pretrain_weights_sha256") for r in records} - {None}  # None: recorded before the checksum
    if first.get("shared_pretrain") and len(bases) > 1:
        notes = [*notes, "The seeds were fine-tuned from different base models (pretrained weights' SHA-256: "
                 + ", ".join(sorted(str(b)[:12] for b in bases)) + "): compare within a base only."]
    retained = any(r.get("retained_exact_match") is not None for r in records)
    base_scores: dict[int, set[float]] = {}  # per seed (its held-out draw): every kind scores the same base
    for r in records:
        if r.get("base_exact_match") is not None:
            base_scores.setdefault(r["seed"], set()).add(r["base_exact_match"])
    if base_scores:
        notes = [*notes, f"The base's exact match on {first['finetune_tier']}'s held-out problems, before the "
                 "fine-tune, by seed: " + ", ".join(f"{seed}: " + " / ".join(f"{v:.3f}" for v in sorted(scores))
                                                   for seed, scores in sorted(base_scores.items()))
                 + ("" if all(len(v) == 1 for v in base_scores.values())
                    else " (the kinds of a seed disagree: their bases or evaluations differ)") + "."]
    lines = [f"# 8-bit states when fine-tuning ({first['date']})", "", f"`{command}`", "",
             (f"{first['device']}; torch {first['torch']}; {first['model']} pretrained {first['pretrain_steps']} "
             f"steps on {first['pretrain_tier']} (fp32 states; "
             f"{'once, every seed fine-tuned from it' if first.get('shared_pretrain') else 'once per seed'}; "
             + ("plain PyTorch on the device; " if first.get("pretrain_runner") == "torch" else "") +
             f"exact match {first['pretrain_exact_match']:.3f}), fine-tuned {first['finetune_steps']} steps on "
             f"{first['finetune_tier']} at lr {first['lr']}, batch {first['batch_size']}, {first['heldout']} "
             "held-out problems."), "", *(f"{note}\n" for note in notes),
             "Along the run: per seed, the mean over the fine-tune (every 10th step's loss) of |loss / fp32's "
             "loss - 1|, in %, and its mean over the seeds [90% interval, seeds resampled]: the null's shows how far float "
             "rounding alone moves a run. Exact match is on the "
             "fine-tuning tier"
             + (f"; retained: on {first['pretrain_tier']} after the fine-tune." if retained else "."), "",
             ("| kind | seeds | exact match mean | " + ("retained mean | " if retained else "")
              + "tail loss mean | tail loss / fp32 [90%] | exact match - fp32, points [90%] | along the run, "
              "% per seed |"),
             "| --- | --- | --- | " + ("--- | " if retained else "") + "--- | --- | --- | --- |"]
    fp32 = by_kind.get("fp32", {})
    for kind, runs in by_kind.items():
        seeds = sorted(runs)
        em = [runs[s]["exact_match"] for s in seeds]
        tail = [runs[s]["tail_loss"] for s in seeds]
        row = f"| {kind} | {', '.join(map(str, seeds))} | {statistics.fmean(em):.4f} |"
        if retained:
            kept = [runs[s]["retained_exact_match"] for s in seeds if runs[s].get("retained_exact_match") is not None]
            row += f" {statistics.fmean(kept):.4f} |" if kept else " - |"
        row += f" {statistics.fmean(tail):.5g} |"
        paired = [s for s in seeds if s in fp32]
        if kind != "fp32" and paired:
            base_tail = [fp32[s]["tail_loss"] for s in paired]
            base_em = [fp32[s]["exact_match"] for s in paired]
            mine_tail = [runs[s]["tail_loss"] for s in paired]
            mine_em = [runs[s]["exact_match"] for s in paired]
            lo, hi = interval(mine_tail, base_tail, ratio)
            plo, phi = interval(mine_em, base_em, points)
            along = [deviation(runs[s]["loss_every_10_steps"], fp32[s]["loss_every_10_steps"]) for s in paired]
            row += (f" {statistics.fmean(mine_tail) / statistics.fmean(base_tail):.5f} [{lo:.5f}, {hi:.5f}] |"
                    f" {100 * (statistics.fmean(mine_em) - statistics.fmean(base_em)):+.1f} [{plo:+.1f}, {phi:+.1f}] |"
                    f" {' / '.join(f'{100 * d:.3f}' for d in along)}{along_mean(along)} |")
        else:
            row += " - | - | - |"
        lines.append(row)
    if repeats:
        lines += ["", ("Repeats: a kind and seed run again (in another call, from the same base) against its first "
                       "run above, which the table counts; how far one run moves from itself."), "",
                  "| kind | seed | tail loss / first | along the run, % | exact match, first / repeat | seconds, first / repeat |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in repeats:
            f = by_kind[r["kind"]][r["seed"]]
            lines.append(f"| {r['kind']} | {r['seed']} | {r['tail_loss'] / f['tail_loss']:.5f} | "
                         f"{100 * deviation(r['loss_every_10_steps'], f['loss_every_10_steps']):.3f} | "
                         f"{f['exact_match']:.3f} / {r['exact_match']:.3f} | {f['seconds']:.0f} / {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def along_mean(along: list[float]) -> str:
    """"; mean M [LO, HI]" in %, the 90% interval from resampling the seeds (two or more)."""
    if len(along) < 2:
        return ""
    lo, hi = interval(along, along, lambda a, _: a)
    return f"; mean {100 * statistics.fmean(along):.3f} [{100 * lo:.3f}, {100 * hi:.3f}]"


def deviation(curve: list[float], base: list[float]) -> float:
    """Mean of |curve / base - 1| over two loss curves' points (the shorter one's length)."""
    return statistics.fmean(abs(a / b - 1) for a, b in zip(curve, base))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(DEFAULT_KINDS))
    parser.add_argument("--pretrain-tier", default="add2")
    parser.add_argument("--pretrain-steps", type=int, default=600)
    parser.add_argument("--shared-pretrain", action=argparse.BooleanOptionalAction, default=True,
                        help="pretrain once (with the first seed) and fine-tune every seed from it, as users "
                             "fine-tune one base model (--no-shared-pretrain: one pretraining per seed)")
    parser.add_argument("--pretrain-lr", type=float, default=3e-4)
    parser.add_argument("--pretrain-seed", type=int, default=None,
                        help="seed of the shared pretraining (default: the first of --seeds); a reused "
                             "--pretrained folder must have been made with it")
    parser.add_argument("--pretrain-runner", choices=["lazytrain", "torch"], default="lazytrain",
                        help="pretrain with LazyTrain (fp32 CPU AdamW states) or plain PyTorch on the device "
                             "(torch AdamW there; bf16 autocast on a GPU): the pretraining is not under study")
    parser.add_argument("--finetune-tier", default="addsub")
    parser.add_argument("--finetune-steps", type=int, default=300)
    parser.add_argument("--finetune-lr", type=float, default=1e-5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--tail", type=int, default=50, help="last fine-tuning steps whose mean loss is compared")
    parser.add_argument("--dtype", default="auto", help="model.dtype of every run (bf16 on the CPU for the kinds "
                        "with a bf16 master, whose reference is then bf16 compute with the exact split master)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--scratch", default=None, help="folder for temporary folders: pretrained and fine-tuned "
                                                        "models, checkpoints (default: the system's)")
    parser.add_argument("--pretrained", default=None,
                        help="folder of the shared pretraining (DIR/pretrained, DIR/pretrained.json): reused when "
                             "there, else made there and kept (default: a temporary folder)")
    parser.add_argument("--pretrain-only", action="store_true", help="pretrain into --pretrained and stop")
    parser.add_argument("--runs", nargs="+", type=kind_seed, default=[], metavar="KIND:SEED",
                        help="with --jobs: exactly these fine-tunes, in this order, instead of --kinds x --seeds "
                             "(to complete a study across calls)")
    parser.add_argument("--jobs", type=int, default=0,
                        help="fine-tune in processes of their own, this many at once (see the top of this file)")
    parser.add_argument("--time-limit", type=float, default=0,
                        help="with --jobs: seconds after which running fine-tunes are stopped; what finished is "
                             "merged")
    parser.add_argument("--expect", nargs="+", default=[], metavar="KIND=SECONDS", type=expectation,
                        help="with --jobs and --time-limit: how long a fine-tune of KIND took before (the "
                             "records' seconds); none is started that cannot finish by the limit")
    parser.add_argument("--pretrain-threads", type=int, default=0,
                        help="with --jobs: CPU threads of the pretraining (default: all cores)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--tag", default="")
    parser.add_argument("--merge", nargs="+", help="record files to report as one (no training)")
    parser.add_argument("--note", action="append", default=[],
                        help="with --merge: a line for the report (how the merged runs were made), repeatable")
    args = parser.parse_args(argv)
    if args.pretrain_seed is None:
        args.pretrain_seed = args.seeds[0]
    if args.runs and not args.jobs:
        parser.error("--runs lists the fine-tunes of a --jobs study: give --jobs N too")
    if args.pretrain_only and not args.pretrained:
        parser.error("--pretrain-only needs --pretrained DIR (where the pretraining is kept)")
    if (args.jobs or args.pretrained) and not args.shared_pretrain:
        parser.error("--jobs and --pretrained share one pretraining: leave out --no-shared-pretrain")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.merge:
        first = json.loads(Path(args.merge[0]).read_text())[0]
        merge([Path(f) for f in args.merge], f"finetune_8bit_{first['model'].split(':')[-1]}_{today()}{args.tag}",
              f"python -m bench.studies.accuracy_finetune_8bit --merge {' '.join(args.merge)}"
              + (f" --tag {args.tag}" if args.tag else "") + "".join(f" --note {shlex.quote(n)}" for n in args.note),
              args.out, args.note)
    elif args.jobs:
        parallel_study(args)
    else:
        records = study(args)
        if records:
            text = report(records, command_line(args))
            write_results(records, f"finetune_8bit_{args.shape}_{today()}{args.tag}", text, args.out)
            print(text)


if __name__ == "__main__":
    main()
