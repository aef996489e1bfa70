"""``lazytrain train | plan | profile | eval | config``.

Every command takes an optional YAML config and ``section.key=value`` overrides. Errors a
user can fix (a `LazyTrainError`: bad config, missing files, memory that does not fit, bad
data) print one message and exit with status 2, without a traceback; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from lazytrain.config import ConfigError, load_config
from lazytrain.errors import LazyTrainError


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
    from lazytrain.eval.evaluate import evaluate

    path, overrides = _split_args(args.items)
    report = evaluate(load_config(path, overrides).eval)
    print(json.dumps(report, indent=1))
    print(
        f"exact match {report['accuracy']:.1%} ({report['correct']}/{report['n']}), "
        f"{report['no_answer']} without an answer; predictions in {report['predictions']}",
        file=sys.stderr,
    )
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from lazytrain.train.session import build_session

    path, overrides = _split_args(args.items)
    config = load_config(path, overrides)
    config.plan.costs = None
    session = build_session(config)
    costs = session.cost_table()
    out = Path(config.training.output_dir) / "costs.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    costs.save(out)
    types = costs.type_costs()
    per_type = "; ".join(
        (f"{kind} layer " if len(types) > 1 else "layer ")
        + f"forward {layer.forward_ms:.2f} ms, recompute {layer.recompute_ms:.2f} ms, "
        f"backward {layer.backward_ms:.2f} ms, saved {layer.saved_bytes / 2**20:.1f} MiB"
        + "".join(
            f" ({name} recomputed: saved {rc.saved_bytes / 2**20:.1f} MiB, +{rc.recompute_ms:.2f} ms)"
            for name, rc in layer.recompute_options.items()
        )
        for kind, layer in types.items()
    )
    print(
        f"profiled {session.adapter.arch} on {costs.device} at batch {costs.batch_size} x seq "
        f"{costs.seq_len}, {costs.attention} attention: {per_type}; H2D "
        f"{costs.h2d_gbps:.1f} GB/s, D2H {costs.d2h_gbps:.1f} GB/s, optimizer ({costs.optimizer}) "
        f"{costs.optimizer_ns_per_param:.2f} ns/param; written to {out}",
        file=sys.stderr,
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from lazytrain.plan.policies import comparison_plans
    from lazytrain.plan.render import (
        format_batch_sweep,
        format_memory_components,
        format_plan_table,
        render_plan_png,
    )
    from lazytrain.plan.simulate import simulate
    from lazytrain.train.plan_ahead import plan_ahead

    path, overrides = _split_args(args.items)
    config = load_config(path, overrides)
    ahead = plan_ahead(config)  # from the model's shape: no weights read or allocated
    plan, costs = ahead.plan, ahead.costs
    overlap = config.plan.overlap_optimizer
    sim = simulate(plan, costs, optimizer_overlap=overlap)
    print(f"{ahead.arch}, {ahead.num_params / 1e9:.2f}B parameters; cost table: {ahead.source}\n")
    print(format_plan_table(plan, sim, costs))
    print(f"\nhost memory (model state + this plan's host-tier activations):\n{ahead.host.table()}")
    print(f"\n{format_memory_components(sim, ahead.host.components())}")
    if not ahead.host.fits:
        print(f"\nhost memory does NOT fit: {ahead.host.total / 2**30:.2f} GiB needed, {ahead.host.limit / 2**30:.2f} GiB "
              "in the budget; smallest change that fits: "
              + (f"set {ahead.fix}" if ahead.fix else "none (a smaller model, or more host memory)"))
    if config.plan.batch_sweep:
        print(f"\nbatch sweep (plan.batch_sweep={config.plan.batch_sweep}, seq {costs.seq_len}; the same cost table "
              "rescaled, the same settings"
              + ("" if ahead.host.fits else "; the host does not fit them, see above") + "):")
        print(format_batch_sweep(ahead.sweep.tried, ahead.sweep.plan.batch_size) if ahead.sweep
              else f"  no batch fits: {ahead.sweep_error}")
    print("\nbaselines (same cost table, same simulator):")
    for baseline in comparison_plans(costs.num_layers, costs.batch_size, costs.seq_len, ahead.planner.options):
        result = simulate(baseline, costs, optimizer_overlap=overlap)
        verdict = "fits" if result.feasible else "does not fit: " + "; ".join(result.violations)
        print(f"  {baseline.policy:16s} {result.step_time_s:8.3f} s  peak GPU "
              f"{result.peak_gpu_bytes / 2**30:7.2f} GiB  ({verdict})")
    out = Path(config.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.json")
    try:
        render_plan_png(plan, sim, out / "plan.png", costs)
        drawn = f" and {out / 'plan.png'}"
    except ImportError as error:
        drawn = f" (no plan.png: {error})"
    print(f"\nwritten: {out / 'plan.json'}{drawn}", file=sys.stderr)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from lazytrain.cli.reference import reference_markdown

    text = reference_markdown()
    if args.write is None:
        print(text, end="")
        return 0
    path = Path(args.write)
    try:
        path.write_text(text)
    except OSError as error:
        raise ConfigError(f"the reference cannot be written to {path} ({error.strerror}); pass a "
                          "writable file path to --write") from None
    print(f"written: {path}", file=sys.stderr)
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "profile": cmd_profile, "plan": cmd_plan, "config": cmd_config}


def _keys_epilog(sections: tuple[str, ...] | None = None) -> str:
    from lazytrain.cli.reference import REFERENCE_PATH, help_listing

    return (f"configuration keys (section.key=default; the whole text of each: `lazytrain config` or "
            f"{REFERENCE_PATH}):\n{help_listing(sections)}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazytrain", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = argparse.RawDescriptionHelpFormatter
    train = sub.add_parser("train", help="fine-tune a model (default: built-in tiny model and data)",
                           formatter_class=listing, epilog=_keys_epilog())
    train.add_argument("items", nargs="*", help="[config.yaml] [section.key=value ...]")
    prof = sub.add_parser("profile", help="measure this machine and model: writes OUTPUT_DIR/costs.json",
                          epilog="the configuration keys: `lazytrain train --help` or `lazytrain config`")
    prof.add_argument("items", nargs="*", help="[config.yaml] [section.key=value ...]")
    plan = sub.add_parser("plan", help="solve the per-layer plan (MILP) from the model's shape, without loading "
                          "weights: prints it, writes plan.json, plan.png",
                          epilog="the configuration keys: `lazytrain train --help` or `lazytrain config`")
    plan.add_argument("items", nargs="*", help="[config.yaml] [section.key=value ...] (plan.costs=costs.json from "
                      "`lazytrain profile`; without it a built-in estimate)")
    ev = sub.add_parser("eval", help="exact-match evaluation of a saved model (the eval config section)",
                        formatter_class=listing, epilog=_keys_epilog(("eval",)))
    ev.add_argument("items", nargs="*", help="[config.yaml] [eval.key=value ...] (eval.model defaults to "
                    "training.output_dir)")
    conf = sub.add_parser("config", help="print the configuration reference: every key, its default and doc "
                          "(Markdown)")
    conf.add_argument("--write", metavar="PATH", help="write it to PATH instead (the repository's copy: "
                      "docs/configuration.md)")
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
    except LazyTrainError as error:
        if args.verbose:
            raise
        print(f"lazytrain {args.command}: error: {error}", file=sys.stderr)
        return getattr(error, "exit_code", 2)  # a signal's 128 + signum
    except KeyboardInterrupt:
        if args.verbose:
            raise
        # outside the training loop (set-up, or a second Ctrl-C): nothing more is saved
        print(f"lazytrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
