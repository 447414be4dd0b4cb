"""`python -m benchmarks {SECTION [SECTION ...],all,report,publish} [--quick | --full] [--out DIR]`.

Sections: speed, host, memory, work, model, precision, long; several run in one call (e.g. `host model`), in the
order of SECTIONS whatever the order given. `all` runs every section but precision and long."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import common, cost_model, host_overhead, long_prompt, memory, precision, report, speed, work

# Sections run in this order: the cost model reads the host-overhead result.
SECTIONS = {"work": work.run, "host": host_overhead.run, "model": cost_model.run, "memory": memory.run,
            "speed": speed.run, "precision": precision.run, "long": long_prompt.run}
# `all`: every section but these, which run only when named (precision's full mode takes hours on 2 cores; long
# runs HF and the patched model at prompts up to 8k tokens, each in its own process: about half an hour)
ONLY_WHEN_NAMED = ("precision", "long")
ALL = tuple(name for name in SECTIONS if name not in ONLY_WHEN_NAMED)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("commands", nargs="+", metavar="command", choices=[*SECTIONS, "all", "report", "publish"],
                        help="one or more sections, all of them, `report` (summary.md from existing results) or "
                             "`publish` (copy plots and tables into benchmarks/README.md)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="fewer prompt lengths, tokens and repeats (a few minutes)")
    size.add_argument("--full", dest="mode", action="store_const", const="full", help="the full set (default)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="results folder (default: %(default)s)")
    args = parser.parse_args(argv)
    mode = args.mode or "full"
    alone = {"all", "report", "publish"} & set(args.commands)
    if alone and len(args.commands) > 1:
        parser.error(f"command: {', '.join(sorted(alone))} cannot be combined with other commands, got "
                     f"{' '.join(args.commands)}")

    def log(message: str) -> None:
        print(message, flush=True)

    if args.commands == ["publish"]:
        log(f"updated {report.publish(args.out)}")
        return 0
    chosen = [name for name in SECTIONS if name in args.commands or (args.commands == ["all"] and name in ALL)]
    for name in chosen:
        started = time.perf_counter()
        log(f"== {name} ({mode})")
        SECTIONS[name](mode, args.out, log=log)
        log(f"== {name} done in {time.perf_counter() - started:.0f} s")
    if not report.load(args.out):
        if not chosen:
            parser.error(f"--out: no results in {args.out}; run a section first (e.g. `python -m benchmarks model`)")
        log(f"summary: none (no section with a summary table has results in {args.out})")
        return 0
    summary = report.write_summary(args.out)
    missed = [t for r in report.load(args.out).values() for t in r.get("targets", []) if not t["met"]]
    log(f"summary: {summary}")
    for t in missed:
        log(f"target missed: {t['name']}: {t['measured']} (target {t['target']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
