"""``lazytrain train | plan | profile | eval | export``.

Every command takes an optional YAML config and ``section.key=value`` overrides. Errors a
user can fix (bad config, missing files, memory that does not fit, bad data) print one
message and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from lazytrain.config import ConfigError, load_config


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    config_path = None
    overrides = []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif config_path is None:
            config_path = item
        else:
            raise ConfigError(f"unexpected argument {item!r}: give one config file and key=value overrides")
    return config_path, overrides


def cmd_train(args: argparse.Namespace) -> int:
    from lazytrain.train.trainer import Trainer

    path, overrides = _split_args(args.items)
    config = load_config(path, overrides)
    trainer = Trainer(config)
    trainer.setup()
    if not trainer.is_main:  # data parallel: rank 0 reports
        trainer.train()
        return 0
    print(
        f"lazytrain: {trainer.adapter.arch} {trainer.store.num_params / 1e6:.1f}M params on "
        f"{trainer.device} ({str(trainer.dtype).removeprefix('torch.')}), plan {trainer.plan.policy}, "
        f"batch {config.training.batch_size}"
        + (f" over {trainer.parallel.world_size} ranks" if trainer.parallel is not None else "")
        + f"; data: {trainer.data_report.summary()}",
        file=sys.stderr,
    )
    summary = trainer.train()
    last = summary["last"] or {}
    print(
        f"lazytrain: {summary['steps']} steps, final loss {last.get('loss', float('nan')):.4f}, "
        f"{summary['skipped_steps']} skipped; model written to {trainer.out_dir}",
        file=sys.stderr,
    )
    if summary["eval"]:
        ev = summary["eval"]
        print(
            f"lazytrain: held-out exact match {ev['eval_exact_match']:.1%} on {ev['eval_samples']} "
            f"problems ({ev['eval_no_answer']} without an answer)",
            file=sys.stderr,
        )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from lazytrain.eval.evaluate import EvalConfig, evaluate

    cfg = EvalConfig(
        model=args.model, data=args.data, format=args.format, builtin_tier=args.tier,
        num_samples=args.num_samples, seed=args.seed, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, device=args.device, mode=args.mode, template=args.template,
        output=args.output, **({"stop": tuple(args.stop)} if args.stop is not None else {}),
    )
    report = evaluate(cfg)
    print(json.dumps(report, indent=1))
    print(
        f"exact match {report['accuracy']:.1%} ({report['correct']}/{report['n']}), "
        f"{report['no_answer']} without an answer; predictions in {report['predictions']}",
        file=sys.stderr,
    )
    return 0


def _setup_without_data(config):
    """A trainer with model, optimizer and plan inputs, for profile and plan."""
    from lazytrain.train.trainer import Trainer

    config.plan.policy = "keep_all"  # the executor built at setup is not used
    trainer = Trainer(config)
    trainer.setup()
    return trainer


def cmd_profile(args: argparse.Namespace) -> int:
    path, overrides = _split_args(args.items)
    config = load_config(path, overrides)
    config.plan.costs = None
    trainer = _setup_without_data(config)
    costs = trainer.cost_table()
    out = trainer.out_dir / "costs.json"
    costs.save(out)
    layer = costs.layers[0]
    print(
        f"profiled {trainer.adapter.arch} on {costs.device} at batch {costs.batch_size} x seq "
        f"{costs.seq_len}: layer forward {layer.forward_ms:.2f} ms, recompute {layer.recompute_ms:.2f} ms, "
        f"backward {layer.backward_ms:.2f} ms, saved {layer.saved_bytes / 2**20:.1f} MiB; H2D "
        f"{costs.h2d_gbps:.1f} GB/s, D2H {costs.d2h_gbps:.1f} GB/s, optimizer "
        f"{costs.optimizer_ns_per_param:.2f} ns/param; written to {out}",
        file=sys.stderr,
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from lazytrain.plan.plan import checkpoint_all_plan, keep_all_plan, megatrain_plan
    from lazytrain.plan.render import format_plan_table, render_plan_png
    from lazytrain.plan.simulate import simulate
    from lazytrain.train.trainer import solved_plan

    path, overrides = _split_args(args.items)
    config = load_config(path, overrides)
    trainer = _setup_without_data(config)
    costs = trainer.cost_table()
    if config.memory.gpu_gb:
        costs.gpu_bytes = int(config.memory.gpu_gb * 2**30)
    plan = solved_plan(config, costs)
    overlap = config.plan.overlap_optimizer
    sim = simulate(plan, costs, optimizer_overlap=overlap)
    print(format_plan_table(plan, sim, costs))
    L, b, s = costs.num_layers, costs.batch_size, costs.seq_len
    chunk = config.plan.head_chunk_tokens
    print("\nbaselines (same cost table, same simulator):")
    for baseline in (megatrain_plan(L, b, s, config.plan.megatrain_every, chunk), keep_all_plan(L, b, s, chunk),
                     checkpoint_all_plan(L, b, s, "gpu", chunk), checkpoint_all_plan(L, b, s, "host", chunk)):
        result = simulate(baseline, costs, optimizer_overlap=overlap)
        verdict = "fits" if result.feasible else "does not fit: " + "; ".join(result.violations)
        print(f"  {baseline.policy:16s} {result.step_time_s:8.3f} s  peak GPU "
              f"{result.peak_gpu_bytes / 2**30:7.2f} GiB  ({verdict})")
    trainer.out_dir.mkdir(parents=True, exist_ok=True)
    plan.save(trainer.out_dir / "plan.json")
    try:
        render_plan_png(plan, sim, trainer.out_dir / "plan.png")
        drawn = f" and {trainer.out_dir / 'plan.png'}"
    except ImportError as error:
        drawn = f" (no plan.png: {error})"
    print(f"\nwritten: {trainer.out_dir / 'plan.json'}{drawn}", file=sys.stderr)
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "profile": cmd_profile, "plan": cmd_plan}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazytrain", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="fine-tune a model (default: built-in tiny model and data)")
    train.add_argument("items", nargs="*", help="[config.yaml] [section.key=value ...]")
    prof = sub.add_parser("profile", help="measure this machine and model: writes OUTPUT_DIR/costs.json")
    prof.add_argument("items", nargs="*", help="[config.yaml] [section.key=value ...]")
    plan = sub.add_parser("plan", help="solve the per-layer plan (MILP): prints it, writes plan.json, plan.png")
    plan.add_argument("items", nargs="*", help="[config.yaml] [section.key=value ...] (plan.costs=costs.json)")
    ev = sub.add_parser("eval", help="exact-match evaluation of a saved model")
    ev.add_argument("--model", required=True, help="model folder (a training run's output_dir)")
    ev.add_argument("--data", default="builtin", help="'builtin' (held-out split) or a local data file")
    ev.add_argument("--format", default="auto", help="data format (auto, metamathqa, alpaca, json, jsonl, parquet)")
    ev.add_argument("--tier", default="add2", help="built-in data tier")
    ev.add_argument("--num-samples", type=int, default=200)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--max-new-tokens", type=int, default=64)
    ev.add_argument("--batch-size", type=int, default=64)
    ev.add_argument("--device", default="auto")
    ev.add_argument("--mode", default="auto", choices=["auto", "resident", "streamed"])
    ev.add_argument("--template", default="saved", help="'saved' (the model's) or a template name")
    ev.add_argument("--output", default=None, help="predictions JSONL path")
    ev.add_argument("--stop", action="append", default=None,
                    help="cut generations at this string (repeatable; default: blank lines, "
                    "a new '### Instruction' or 'Q:')")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, ValueError, FileNotFoundError, MemoryError) as error:
        if args.verbose:
            raise
        print(f"lazytrain {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
