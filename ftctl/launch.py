"""Starting the worker processes of a multi-process run through torch's launcher (torchrun).

``ftctl train`` resolves and validates the config once, writes it to the run dir, and then starts
``torch.distributed.run`` with an argument list (never a shell string); each worker runs
:mod:`ftctl.worker` on that config file. Run as ``python -m ftctl.launch TORCHRUN_ARGS...`` this
module is torchrun itself, minus the launcher's traceback when a worker fails: workers report
their error through files the parent turns into one message.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

from ftctl.config.schema import RunConfig
from ftctl.errors import ConfigError, FtctlError

ERROR_DIR_ENV = "FTCTL_ERROR_DIR"  # where each worker writes rank<N>.json when it fails with an FtctlError
NODE_CONFIG_PREFIX = "ftctl-node-config-"

log = logging.getLogger("ftctl")


def world_size(cfg: RunConfig) -> int:
    return cfg.parallel.nproc_per_node * cfg.parallel.nnodes


def torchrun_args(cfg: RunConfig, config_path: Path, run_dir: Path) -> List[str]:
    """torchrun's arguments for this node, ending in the worker module and its arguments."""
    p = cfg.parallel
    args = ["--nproc-per-node", str(p.nproc_per_node), "--nnodes", str(p.nnodes), "--max-restarts", "0"]
    if p.nnodes == 1:
        # A private rendezvous on a free local port: several one-node runs can share a machine.
        args.append("--standalone")
    elif p.rdzv_backend == "static":
        args += ["--rdzv-backend", "static", "--node-rank", str(p.node_rank),
                 "--master-addr", p.master_addr, "--master-port", str(p.master_port)]
    else:
        args += ["--rdzv-backend", p.rdzv_backend, "--rdzv-endpoint", f"{p.master_addr}:{p.master_port}",
                 "--rdzv-id", p.rdzv_id, "--node-rank", str(p.node_rank)]
    return args + ["--module", "ftctl.worker", str(config_path), "--run-dir", str(run_dir)]


def worker_env(cfg: RunConfig, error_dir: Path) -> dict:
    env = dict(os.environ)
    env[ERROR_DIR_ENV] = str(error_dir)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Without this torchrun pins every worker to one thread and warns; share the cores out instead.
    threads = cfg.train.num_threads or max(1, (os.cpu_count() or 1) // cfg.parallel.nproc_per_node)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def launch_workers(cfg: RunConfig, run_dir: Path, config_path: Optional[Path] = None) -> None:
    """Run this node's workers to completion; raise one FtctlError if any of them failed.

    Node 0 passes the run dir's config.yaml. Another node (``config_path`` None) does not touch the
    run dir before training, which node 0 owns: its workers read this node's own copy of the config.
    """
    with tempfile.TemporaryDirectory(prefix="ftctl-errors-") as errors, tempfile.TemporaryDirectory(prefix=NODE_CONFIG_PREFIX) as scratch:
        if config_path is None:
            from ftctl.config.compose import to_yaml

            config_path = Path(scratch) / "config.yaml"
            config_path.write_text(to_yaml(cfg))
        command = [sys.executable, "-m", "ftctl.launch", *torchrun_args(cfg, config_path, run_dir)]
        log.info("starting %d worker processes on this node (%d in all, parallel=%s)",
                 cfg.parallel.nproc_per_node, world_size(cfg), cfg.parallel.name)
        log.debug("launch: %s", command)
        launcher = subprocess.Popen(command, env=worker_env(cfg, Path(errors)))
        with _signals_go_to(launcher):
            returncode = launcher.wait()
        if returncode:
            raise worker_failure(Path(errors), returncode)


@contextlib.contextmanager
def _signals_go_to(launcher: subprocess.Popen):
    """While the workers run, a SIGTERM for this process is passed on to the launcher, which passes it to every
    worker (they checkpoint and stop at the next step). Ctrl-C reaches the workers directly, as the whole
    process group gets it; this process just waits for them to finish saving."""
    handlers = {signal.SIGTERM: lambda signum, frame: launcher.send_signal(signum), signal.SIGINT: signal.SIG_IGN}
    previous = {}
    try:
        for sig, handler in handlers.items():
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: signals stay with the caller
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def worker_failure(error_dir: Path, returncode: int) -> FtctlError:
    """One error for the user from what the failed workers reported (identical messages merged)."""
    by_message, exit_codes = {}, []
    for path in sorted(error_dir.glob("rank*.json"), key=lambda p: int(p.stem[4:])):
        report = json.loads(path.read_text())
        by_message.setdefault((report["type"], report["message"]), []).append(str(report["rank"]))
        exit_codes.append(report.get("exit_code", 1))
    if not by_message:
        return FtctlError(f"a training worker failed (launcher exit code {returncode}); its output is above")
    lines = [message if len(by_message) == 1 else f"rank {', '.join(ranks)}: {message}"
             for (kind, message), ranks in by_message.items()]
    error_class = ConfigError if all(kind == "ConfigError" for kind, _ in by_message) else FtctlError
    error = error_class("\n".join(lines))
    error.exit_code = exit_codes[0]  # e.g. an interrupted run's 143, as in a single-process run
    return error


def report_worker_error(rank: int, exc: FtctlError) -> bool:
    """Write a worker's error where the launching parent reads it; False when not launched by ftctl."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if not error_dir:
        return False
    record = {"rank": rank, "type": type(exc).__name__, "message": str(exc), "exit_code": exc.exit_code}
    Path(error_dir, f"rank{rank}.json").write_text(json.dumps(record))
    return True


def main(argv: Optional[List[str]] = None) -> int:
    """torchrun with a quiet failure: the workers' own errors are what the user needs to see."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torch's elastic modules give each of their loggers its own level; the parent's does not reach them.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")] + ["torch.distributed.elastic"]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError:
        return 1
    except SignalException as exc:  # the workers got the signal too and said what they did
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
