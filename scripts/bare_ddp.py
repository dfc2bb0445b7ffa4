"""The bare PyTorch baseline: the job's model and data in a plain DistributedDataParallel loop.

    python scripts/bare_ddp.py --config configs/tiny-cpu.yaml [--set KEY=VALUE]... [--steps 200] [--log-every 20]

Run directly, it launches itself the way torchrun would (`python -m torch.distributed.run --standalone
--nproc_per_node W`, one process per worker, OMP_NUM_THREADS=1 unless already set: torch's default of one
thread per core in every process oversubscribes the cores). Each worker builds the same Transformer
(rayspeed.model.transformer, same seed), the same global batches (rayspeed.data: same corpus, seq_len, global
batch, micro-batch and accumulation as the platform's plan for W workers), torch AdamW (fused, as the platform
uses it) with the same param groups, betas and schedule, gradient clipping, gloo and DDP. No Ray, no DeepSpeed,
no MLflow.

Like the platform's worker loop it reads the loss on the host only at log steps and times each window of
--log-every steps with perf_counter (the platform's perf/step_time_s). Rank 0 prints one JSON line:
{"bare_ddp": {..., "window_step_s": [...], "window_end_at": [...], "first_step_at": <epoch s>, "started_at": ...}}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import rayspeed  # noqa: F401
except ImportError:  # a bare checkout: the source tree next to this file
    sys.path.insert(0, str(ROOT / "platform"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/bare_ddp.py", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "tiny-cpu.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps")
    ap.add_argument("--log-every", type=int, default=20, help="steps per timing window (loss read then)")
    ap.add_argument("--workers", type=int, default=None, help="processes (default: the job's cluster.num_workers)")
    ap.add_argument("--cache-dir", default=None, help="token cache (default: <RAYSPEED_HOME or repo>/runs/.cache/data)")
    ap.add_argument("--json-out", default=None, help="also write rank 0's JSON object here")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process when not already set")
    ap.add_argument("--unfused-adamw", action="store_true", help="torch's default (for-loop) AdamW on CPU")
    ap.add_argument("--kill", default=None, metavar="RANK:STEP",
                    help="the recovery drill: that rank SIGKILLs itself after that step, in the first attempt only")
    ap.add_argument("--kill-marker", default=None, help="the drill writes the kill's epoch time here")
    ap.add_argument("--max-restarts", type=int, default=0, help="torchrun's --max-restarts")
    return ap.parse_args(argv)


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    from rayspeed.config.load import load

    workers = args.workers or load(args.config, args.set).cluster.max_workers
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    env["RAYSPEED_BARE_LAUNCHED_AT"] = env.get("RAYSPEED_BARE_LAUNCHED_AT", repr(time.time()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}",
           f"--max-restarts={args.max_restarts}", str(Path(__file__).resolve()), *argv]
    return subprocess.call(cmd, env=env)


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rayspeed.config.load import load
    from rayspeed.config.shape import ModelShape
    from rayspeed.data import RankBatches, build_token_file, make_schedule
    from rayspeed.engine.optim import lr_factor, param_groups
    from rayspeed.model.transformer import Transformer
    from rayspeed.planner import resolve

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        dist.init_process_group("gloo")
    else:  # torchrun's store still holds the dead attempt's gloo addresses (torch 2.13): a fresh key space
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                                world_size=world)
    rank, world = dist.get_rank(), dist.get_world_size()

    # The same resolved job the platform's workers run for this world size (planner: pure Python, ~10 ms).
    # train.max_steps follows --steps, as bench.py sets it for the platform (the LR schedule spans the run).
    cfg, _ = resolve(load(args.config, [*args.set, f"train.max_steps={args.steps}"]), world_size=world)
    par, t, m = cfg.parallel, cfg.train, cfg.model
    if par.tp != 1 or par.pp != 1:
        raise SystemExit(f"bare_ddp compares pure data parallelism; the plan has tp={par.tp} pp={par.pp}")
    if t.precision != "fp32":
        raise SystemExit(f"bare_ddp runs fp32 on CPU; the plan says {t.precision}")

    torch.manual_seed(t.seed)
    mcfg = ModelShape.from_config(m)
    model = Transformer(mcfg, seed=t.seed)
    ddp = DDP(model)
    # Fused AdamW, as the platform uses (torch supports it on CPU too): the same optimizer kernel on both sides.
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay, float(t.lr)), lr=float(t.lr),
                            betas=(t.adam_beta1, t.adam_beta2), eps=1e-8, fused=not args.unfused_adamw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))

    home = Path(os.environ.get("RAYSPEED_HOME", str(ROOT)))
    cache = args.cache_dir or str(home / "runs" / ".cache" / "data")
    tf = build_token_file(cfg.data.source, cfg.data.path, cfg.data.tokenizer, cache)
    train, _ = tf.split(cfg.data.val_fraction, m.seq_len)
    schedule = make_schedule(train, m.seq_len, t.global_batch_size, t.seed)
    batches = RankBatches(train, m.seq_len, schedule, rank, world, par.micro_batch_size, par.grad_accum)

    accum = par.grad_accum
    loss_acc = torch.zeros(())
    windows: list[float] = []
    window_end_at: list[float] = []
    losses: list[float] = []
    first_step_at = None
    kill_rank, kill_step = (int(v) for v in args.kill.split(":")) if args.kill and attempt == 0 else (-1, -1)
    model.train()
    t0 = time.perf_counter()
    n = 0
    for step, micro in batches.iterate(0, args.steps):
        total = torch.zeros(())
        for i, (x, y) in enumerate(micro):
            sync = contextlib.nullcontext() if i == accum - 1 else ddp.no_sync()
            with sync:
                loss = ddp(x, y)
                (loss / accum).backward()
            total += loss.detach()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_acc += total / accum
        n += 1
        done = step + 1
        if first_step_at is None:
            first_step_at = time.time()
        if rank == kill_rank and done == kill_step:
            if args.kill_marker:
                Path(args.kill_marker).write_text(repr(time.time()))
            os.kill(os.getpid(), 9)  # as the platform's chaos kill: no teardown of its own
        if done % args.log_every == 0 or done == args.steps:
            mean = loss_acc / n  # the only host sync: the loss at log steps
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
            windows.append((time.perf_counter() - t0) / n)
            window_end_at.append(time.time())
            loss_acc.zero_()
            n = 0
            t0 = time.perf_counter()
    if rank == 0:
        started = os.environ.get("RAYSPEED_BARE_LAUNCHED_AT")
        out = {
            "world_size": world,
            "threads_per_process": torch.get_num_threads(),
            "steps": args.steps,
            "log_every": args.log_every,
            "micro_batch_size": par.micro_batch_size,
            "grad_accum": accum,
            "adamw": "for-loop" if args.unfused_adamw else "fused",
            "global_batch_size": t.global_batch_size,
            "seq_len": m.seq_len,
            "window_step_s": windows,
            "window_end_at": window_end_at,
            "losses": losses,
            "final_loss": losses[-1] if losses else None,
            "first_step_at": first_step_at,
            "started_at": float(started) if started else None,
            "attempt": attempt,
        }
        line = json.dumps({"bare_ddp": out})
        print(line, flush=True)
        if args.json_out:
            Path(args.json_out).write_text(line + "\n")
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _worker(args)
    return _launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
