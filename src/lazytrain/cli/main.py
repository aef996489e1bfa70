"""``lazytrain train | plan | profile | eval | export``.

Every command takes an optional YAML config and ``section.key=value`` overrides. Errors a
user can fix (bad config, missing files, memory that does not fit, bad data) print one
message and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
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
    print(
        f"lazytrain: {trainer.adapter.arch} {trainer.store.num_params / 1e6:.1f}M params on "
        f"{trainer.device} ({str(trainer.dtype).removeprefix('torch.')}), plan {trainer.plan.policy}, "
        f"batch {config.training.batch_size}; data: {trainer.data_report.summary()}",
        file=sys.stderr,
    )
    summary = trainer.train()
    last = summary["last"] or {}
    print(
        f"lazytrain: {summary['steps']} steps, final loss {last.get('loss', float('nan')):.4f}, "
        f"{summary['skipped_steps']} skipped; model written to {trainer.out_dir}",
        file=sys.stderr,
    )
    return 0


COMMANDS = {"train": cmd_train}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazytrain", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="fine-tune a model (default: built-in tiny model and data)")
    train.add_argument("items", nargs="*", help="[config.yaml] [section.key=value ...]")
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
