"""The `rayspeed` command: every subcommand and its arguments, in one place. Handlers live with what they run and
are imported only when their command is chosen, so `rayspeed plan` never pays for torch, Ray or MLflow.

Exit codes (every command): 0 done; 2 the input is wrong (one message naming the key and the fix); 1 the work
failed; `retrain` adds 3 skipped and 4 rejected.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from typing import Callable, Optional

# command -> (module, function) that runs it with the parsed arguments
HANDLERS = {
    "plan": ("rayspeed.planning", "plan_command"),
    "calibrate": ("rayspeed.health.calibrate", "calibrate_command"),
    "train": ("rayspeed.train.launch", "train_command"),
    "keys": ("rayspeed.cli", "keys_command"),
    "healthcheck": ("rayspeed.health.healthcheck", "healthcheck_command"),
    "doctor": ("rayspeed.health.doctor", "doctor_command"),
    "retrain": ("rayspeed.retrain.command", "retrain_command"),
    "schedule": ("rayspeed.retrain.cron", "schedule_command"),
    "export": ("rayspeed.exporting", "export_command"),
}


def _job_args(p: argparse.ArgumentParser, config_required: bool = True) -> None:
    if config_required:
        p.add_argument("--config", required=True, help="job YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a job-file key (the value is parsed as YAML); repeatable")


def _plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="job YAML file")
    _job_args(p, config_required=False)
    p.add_argument("--json", action="store_true", help='print {"plan": ..., "alternatives": [...], "explain": ...}')
    p.add_argument("--top", type=int, default=5, metavar="K", help="runner-up layouts to show (default 5)")
    p.add_argument("--layouts", metavar="FILE.jsonl", help="evaluate these layouts (one JSON object per line) and "
                   "print one JSON line each, in order")
    p.add_argument("--explain", action="store_true", help="print the full explanation")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="plan for N workers instead of cluster.num_workers (its maximum when elastic)")
    p.add_argument("--profile", metavar="FILE", help="a hardware profile from `rayspeed calibrate` (overrides "
                   "cluster.profile; precedence: profile > cluster.hardware > the built-in table)")
    p.add_argument("--calibrate-from", metavar="EXPERIMENT", help="fit the profile's efficiency factors to the "
                   "finished runs of this MLflow experiment (leave-one-out error reported), save it, plan with it")


def _calibrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="the job to calibrate for (its model shapes, cluster section and precision); "
                   "default: a generic job on --workers ranks")
    _job_args(p, config_required=False)
    p.add_argument("--workers", type=int, help="ranks to measure on (default: the job's cluster.num_workers)")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the hardware profile (JSON)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpu", dest="gpu", action="store_true", default=None, help="one GPU per rank, NCCL")
    g.add_argument("--cpu", dest="gpu", action="store_false", help="CPU ranks, gloo")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck rank is reported (300)")
    p.add_argument("--no-mlflow", action="store_true", help="do not record the calibration as an MLflow run")


def _train(p: argparse.ArgumentParser) -> None:
    _job_args(p)
    p.add_argument("--launcher", choices=("ray", "local"), default="ray",
                   help="ray (default): Ray Train; local: this process, world size 1")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and plan, train nothing")
    p.add_argument("--verbose", action="store_true", help="also show the libraries' lines rayspeed silences as "
                   "benign (rayspeed.logs.BENIGN)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fresh", dest="resume", action="store_const", const="fresh", default="auto",
                   help="start over: set the job's previous checkpoints aside (and start a new MLflow run)")
    g.add_argument("--resume-anyway", dest="resume", action="store_const", const="anyway",
                   help="resume the job's checkpoint even though model, data, optimizer or schedule keys changed")


def _healthcheck(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, help="ranks to run (default: the job's cluster.num_workers, else 2)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--config", help="a job file: its cluster section shapes the placement group and environment")
    _job_args(p, config_required=False)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gpu", dest="gpu", action="store_true", default=None, help="one GPU per rank, NCCL")
    g.add_argument("--cpu", dest="gpu", action="store_false", help="CPU ranks, gloo")
    p.add_argument("--min-bytes", default="1K", help="smallest message (default 1K)")
    p.add_argument("--max-bytes", default=None, help="largest message (default 16M on CPU, 1G on GPU)")
    p.add_argument("--iters", type=int, default=None, help="timed repetitions per size (default 5 CPU, 20 GPU)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck rank is reported (300)")


def _doctor(p: argparse.ArgumentParser) -> None:
    from rayspeed.health.doctor import categories_epilog

    p.epilog = categories_epilog()
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("source", nargs="?", help="log file, '-' for stdin, or a Ray job id (with --env: NAME=VALUE lines)")
    p.add_argument("--env", action="store_true", help="lint environment variables instead of reading a log")
    p.add_argument("--json", action="store_true", help='one JSON object: {"findings": [...]}')
    p.add_argument("--config", help="the job file (OOM advice from the planner; --env: its profile and cluster.env)")
    _job_args(p, config_required=False)
    p.add_argument("--workers", type=int, help="--env: cluster size for the profile (default: the job's)")
    p.add_argument("--address", help="Ray dashboard / Jobs API address for a job id (default: RAY_API_SERVER_ADDRESS "
                   "or http://127.0.0.1:8265)")
    p.add_argument("--debug", action="store_true", help="not a production run: debug knobs are information only")


def _retrain(p: argparse.ArgumentParser) -> None:
    _job_args(p)
    p.add_argument("--force", action="store_true", help="retrain even if the data has not changed")
    p.add_argument("--margin", type=float, default=0.0,
                   help="relative val/loss improvement required to promote: new < champion * (1 - margin) (default 0)")
    p.add_argument("--launcher", choices=("ray", "local"), default="ray",
                   help="ray (default): the cluster in RAY_ADDRESS, else an embedded local Ray; local: in-process")
    p.add_argument("--gate", dest="gates", action="append", default=[], metavar="TASK/METRIC[:MIN_DELTA]",
                   help="promote only when the challenger's eval.harness score of TASK/METRIC is at least the "
                        "champion's + MIN_DELTA in the metric's direction (both scored now, the same way; "
                        "repeatable; with gates, val/loss and --margin do not decide)")
    p.add_argument("--cold", action="store_true", help="train from scratch even when a champion exists")
    p.add_argument("--keep-cycles", type=int, default=3,
                   help="cycle folders (checkpoints) kept under storage; older ones are deleted (0: keep all)")
    p.add_argument("--reeval-max-gflop", type=float, default=2000.0,
                   help="re-evaluate the champion on changed data on the CPU only below this cost (GFLOP)")
    p.add_argument("--args", dest="args_string", default="", metavar="STRING",
                   help="more arguments of this command in one string, split like a shell splits words but "
                        "without running anything (what `make retrain ARGS=...` passes)")


def _schedule(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="install|remove|show")
    a = sub.add_parser("install", help="install (or update) the cron line that runs `make retrain`")
    a.add_argument("--cron", default="", help='schedule, e.g. "0 3 * * *"')
    a.add_argument("--config", required=True)
    a.add_argument("--repo", default=".")
    a.add_argument("--log", default=None, help="log file (default <repo>/runs/retrain.log)")
    a.add_argument("--args", default="", help="ARGS passed to make retrain")
    a.add_argument("--dry-run", action="store_true", help="print the line, change nothing")
    a.add_argument("--crontab-cmd", default=None)
    r = sub.add_parser("remove", help="remove the cron line(s) of this repository")
    r.add_argument("--repo", default=".")
    r.add_argument("--config", default=None, help="only the line of this config")
    r.add_argument("--dry-run", action="store_true")
    r.add_argument("--crontab-cmd", default=None)
    s = sub.add_parser("show", help="print the rayspeed-retrain lines")
    s.add_argument("--repo", default=None)
    s.add_argument("--crontab-cmd", default=None)


def _export(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="an MLflow run id, or a rayspeed checkpoint directory (checkpoint_stepN or the "
                                  "job's folder under the storage path)")
    p.add_argument("out", metavar="OUT", help="output directory (must not exist or be empty)")
    p.add_argument("--format", choices=("hf", "peft"), required=True,
                   help="hf: Hugging Face transformers format (an adapter job's adapter merged into its base); "
                        "peft: an adapter job's adapter alone, in PEFT's files")
    p.add_argument("--tracking-uri", default=None, help="MLflow store of the run (default: MLFLOW_TRACKING_URI, "
                                                         "else the repository's mlflow.db)")
    p.add_argument("--config", default=None, help="the job file, for a checkpoint whose manifest has no model "
                                                  "section (written before checkpoints carried one)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of --config")
    p.add_argument("--byte-tokenizer", action="store_true", help="with the byte tokenizer, write a transformers "
                                                                  "tokenizer whose ids are the UTF-8 bytes")
    p.add_argument("--max-shard-size", type=float, default=2.0, metavar="GB",
                   help="largest safetensors file in GB (default 2)")


COMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = [
    ("plan", "the layout to run, its memory and time, and why (no GPU, Ray or torch needed)", _plan),
    ("calibrate", "measure this cluster for the planner (GEMMs at the job's shapes, collectives inside and across "
                  "nodes, p2p, the engine): a hardware profile for `rayspeed plan --profile` / cluster.profile",
     _calibrate),
    ("train", "train a job (same as python jobs/train.py)", _train),
    ("keys", "every job-file key with its type and meaning", lambda p: None),
    ("healthcheck", "inventory, topology and all-reduce/all-gather bandwidth of the Ray cluster", _healthcheck),
    ("doctor", "name the causes and fixes in a job's log; --env lints the environment", _doctor),
    ("retrain", "one retraining cycle: warm start, train, evaluate, register, promote on improvement "
                "(exit 0 promoted, 3 skipped, 4 rejected, 1 failed, 2 bad input)", _retrain),
    ("schedule", "install, remove or show the cron line that runs `make retrain`", _schedule),
    ("export", "write a trained model (MLflow run id or checkpoint dir) as a Hugging Face model directory "
               "(config.json, safetensors, tokenizer)", _export),
]


def build_parser(prog: str = "rayspeed") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Plan, run and track distributed LLM training.")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, help_text, configure in COMMANDS:
        configure(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def keys_command(args: argparse.Namespace) -> int:
    from rayspeed.config.load import describe_keys

    for key, typ, doc in describe_keys():
        print(f"{key:40s} {typ}\n    {doc}")
    return 0


def main(argv: Optional[list[str]] = None, prog: str = "rayspeed") -> int:
    parser = build_parser(prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
        if getattr(args, "args_string", ""):  # --args "...": words split without a shell, parsed like the rest
            try:
                more = shlex.split(args.args_string)
            except ValueError as e:
                print(f"{prog}: --args {args.args_string!r}: {e}", file=sys.stderr)
                return 2
            args = parser.parse_args(argv + more)
    except SystemExit as e:  # argparse printed the usage: --help is 0, a usage error is bad input (2)
        return int(e.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    module, function = HANDLERS[args.command]
    return int(getattr(importlib.import_module(module), function)(args))


if __name__ == "__main__":
    sys.exit(main())
