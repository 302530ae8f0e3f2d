"""Starting the worker processes of a multi-process run through torch's launcher (torchrun).

``ftctl train`` resolves and validates the config once, writes it to the run dir, and then starts
``torch.distributed.run`` with an argument list (never a shell string); each worker runs
:mod:`ftctl.worker` on that config file. Run as ``python -m ftctl.launch TORCHRUN_ARGS...`` this
module is torchrun itself, minus the launcher's traceback when a worker fails: workers report
their error through files the parent turns into one message, and the launcher reports the ranks
that died without one (killed by a signal, or exited) so that the message names them first.

No orphans: the launcher and every worker ask the kernel to kill them when their parent dies
(``PR_SET_PDEATHSIG``; elsewhere a thread watching the parent), so ``kill -9`` of ``ftctl train``
stops the whole run at once, as it stops a single-process run. The launch's scratch files (error
reports, torch's logs, another node's config) live in one temporary dir removed when the launch
ends; one left by a launcher that was killed is removed by the next launch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional

from ftctl.config.schema import RunConfig
from ftctl.errors import ConfigError, FtctlError

ERROR_DIR_ENV = "FTCTL_ERROR_DIR"  # where each worker writes rank<N>.json when it fails, and the launcher launcher.json
PARENT_ENV = "FTCTL_PARENT_PID"  # the process a launcher or worker must not outlive
SCRATCH_PREFIX = "ftctl-launch-"  # + the owning ftctl's PID + "-": a leftover of a dead owner is removed
CRASH = "crash"  # the report type of a worker that failed with something other than an FtctlError

log = logging.getLogger("ftctl")


def world_size(cfg: RunConfig) -> int:
    return cfg.parallel.nproc_per_node * cfg.parallel.nnodes


def mesh_description(cfg: RunConfig) -> str:
    """', mesh pp 2 × dp_shard 4 × tp 8': the mesh nnodes × nproc_per_node ranks make, for parallel=mesh."""
    if cfg.parallel.name != "mesh":
        return ""
    from ftctl.parallel.mesh_shape import mesh_shape

    return f", mesh {mesh_shape(cfg.parallel, world_size(cfg)).describe()}"


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
    remove_stale_scratch()
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-") as scratch:
        errors = Path(scratch) / "errors"
        errors.mkdir()
        if config_path is None:
            from ftctl.config.compose import to_yaml

            config_path = Path(scratch) / "config.yaml"
            config_path.write_text(to_yaml(cfg))
        # torch's launcher would leave an empty torchelastic_* dir in /tmp for every launch without --log-dir.
        command = [sys.executable, "-m", "ftctl.launch", "--log-dir", str(Path(scratch) / "torch_logs"),
                   *torchrun_args(cfg, config_path, run_dir)]
        log.info("starting %d worker processes on this node (%d in all, parallel=%s%s)",
                 cfg.parallel.nproc_per_node, world_size(cfg), cfg.parallel.name, mesh_description(cfg))
        log.debug("launch: %s", command)
        env = worker_env(cfg, errors)
        env[PARENT_ENV] = str(os.getpid())
        launcher = subprocess.Popen(command, env=env)
        with _signals_go_to(launcher):
            returncode = launcher.wait()
        if returncode:
            raise worker_failure(errors, returncode)


def remove_stale_scratch() -> None:
    """Scratch dirs of launches whose ftctl was killed (nothing else removes them)."""
    from ftctl.training.run_lock import process_alive

    pattern = re.compile(rf"^{re.escape(SCRATCH_PREFIX)}(\d+)-")
    for path in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"):
        match = pattern.match(path.name)
        if match and path.is_dir() and not process_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def die_with_parent(parent: Optional[str]) -> None:
    """Ask to be killed when the process ``parent`` (a PID, from the environment) dies; if it is gone already, die now."""
    if not parent:
        return
    parent_pid = int(parent)
    armed = False
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        armed = ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0
    if not armed:  # no parent-death signal here: a thread watches the parent instead
        def watch():
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="ftctl-parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


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
    """One error for the user from what the workers and the launcher reported.

    Ranks that died without a word (a signal, an exit) come first: they are the cause, and what the
    other ranks then hit (a peer gone from a collective) follows, one line each. Identical messages of
    several ranks are merged. A worker that failed with a bug has its traceback printed above.
    """
    reports = sorted((json.loads(p.read_text()) for p in error_dir.glob("rank*.json")), key=lambda r: r["rank"])
    launcher_file = error_dir / "launcher.json"
    failures = json.loads(launcher_file.read_text()) if launcher_file.is_file() else []
    reported = {r["rank"] for r in reports}
    dead = sorted((f for f in failures if f["rank"] not in reported), key=lambda f: (f.get("time") or 0, f["rank"]))
    # Once one rank dies, torch's launcher sends SIGTERM to the others: those are not the cause.
    causes = [f for f in dead if f["exitcode"] != -signal.SIGTERM] or dead
    stopped = [f for f in dead if f not in causes]
    errors = [r for r in reports if r["type"] != CRASH]
    crashes = [r for r in reports if r["type"] == CRASH]
    lines = [f"rank {f['rank']} {_died(f['exitcode'])}" for f in causes]
    by_message = {}
    for report in errors:
        by_message.setdefault((report["type"], report["message"]), []).append(str(report["rank"]))
    lines += [message if len(by_message) == 1 and not dead else f"rank {', '.join(ranks)}: {message}"
              for (kind, message), ranks in by_message.items()]
    crashed = {}
    for report in crashes:
        crashed.setdefault(report["message"], []).append(str(report["rank"]))
    if crashes and not lines:  # nothing else explains it: a bug, whose traceback the user needs
        for report in crashes:
            print(report.get("traceback", ""), file=sys.stderr, end="")
    after = "stopped after it" if lines else "failed (traceback above)"
    lines += [f"rank {', '.join(ranks)} {after}: {message}" for message, ranks in crashed.items()]
    if stopped:
        lines.append(f"rank {', '.join(str(f['rank']) for f in stopped)} stopped after it: the launcher ended it (SIGTERM)")
    if not lines:
        return FtctlError(f"a training worker failed (launcher exit code {returncode}); its output is above")
    error_class = ConfigError if errors and not dead and not crashes and all(r["type"] == "ConfigError" for r in errors) else FtctlError
    error = error_class("\n".join(lines))
    error.exit_code = errors[0].get("exit_code", 1) if errors and not dead else 1  # e.g. an interrupted run's 143
    return error


def _died(exitcode: int) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = ": the out-of-memory killer, or kill -9" if -exitcode == signal.SIGKILL else ""
        return f"was killed by {name} (signal {-exitcode}{why}); the run stopped"
    return f"exited with code {exitcode} without a message; the run stopped"


def report_worker_error(rank: int, exc: BaseException) -> bool:
    """Write a worker's error where the launching parent reads it; False when not launched by ftctl.

    An FtctlError is reported by its message; anything else as a crash, with its traceback kept for the
    parent to print when nothing else explains the failure (a rank whose peer died first stays quiet).
    """
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if not error_dir:
        return False
    if isinstance(exc, FtctlError):
        record = {"rank": rank, "type": type(exc).__name__, "message": str(exc), "exit_code": exc.exit_code}
    else:
        import traceback

        first = re.sub(r"^\[[^\]]*\] ", "", (str(exc).strip().splitlines() or [""])[0])  # gloo's source location
        first = first.split(". ")[0]  # the cause, not the advice that follows it
        record = {"rank": rank, "type": CRASH, "message": f"{type(exc).__name__}: {first}"[:200], "exit_code": 1,
                  "traceback": "".join(traceback.format_exception(exc))}
    Path(error_dir, f"rank{rank}.json").write_text(json.dumps(record))
    return True


def main(argv: Optional[List[str]] = None) -> int:
    """torchrun with a quiet failure: the workers' own errors are what the user needs to see."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    die_with_parent(os.environ.get(PARENT_ENV))
    os.environ[PARENT_ENV] = str(os.getpid())  # the workers' parent is this launcher
    # torch's elastic modules give each of their loggers its own level; the parent's does not reach them.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")] + ["torch.distributed.elastic"]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as exc:
        _report_failures(exc)
        return 1
    except SignalException as exc:  # the workers got the signal too and said what they did
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


def _report_failures(exc) -> None:
    """Which ranks failed and how (exit code, or minus the signal), for the parent's message."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir:
        failures = [{"rank": rank, "exitcode": f.exitcode, "time": f.timestamp} for rank, f in exc.failures.items()]
        Path(error_dir, "launcher.json").write_text(json.dumps(failures))


if __name__ == "__main__":
    sys.exit(main())
