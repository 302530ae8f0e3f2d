"""One rank of a multi-process run.

``python -m ftctl.worker CONFIG [--run-dir DIR]`` is what :mod:`ftctl.launch` has torchrun start in
every worker: it trains the already resolved config in ``CONFIG`` (the run dir's config.yaml).
:func:`train_under_launcher` is the other way in: ``ftctl train`` itself started once per rank by
torchrun, the deepspeed launcher or srun, where rank 0 prepares the run dir and shares it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

from ftctl.console import done_line, quiet_libraries, setup_logging
from ftctl.errors import ConfigError, FtctlError

log = logging.getLogger("ftctl")


def _setup_rank_logging(rank: int, run_dir: Optional[Path], debug: bool) -> None:
    setup_logging(run_dir if rank == 0 else None, debug)
    quiet_libraries(debug)
    if rank != 0 and not debug:
        # Every rank runs the same loop; one voice is enough unless something goes wrong.
        logging.getLogger("ftctl").setLevel(logging.WARNING)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftctl.worker", description="one rank of an ftctl training run")
    parser.add_argument("config", help="resolved config.yaml written by `ftctl train`")
    parser.add_argument("--run-dir", help="run dir (default: the config file's dir)")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    from ftctl.launch import PARENT_ENV, die_with_parent, report_worker_error
    from ftctl.parallel.place import process_place

    die_with_parent(os.environ.get(PARENT_ENV))  # the launcher's death (its ftctl killed) ends this worker too

    rank = process_place().rank
    config_path = Path(args.config)
    run_dir = Path(args.run_dir) if args.run_dir else config_path.parent
    _setup_rank_logging(rank, run_dir, args.debug)
    try:
        from ftctl.config.compose import load_resolved
        from ftctl.training.runner import train

        result = train(load_resolved(config_path), run_dir)
    except FtctlError as exc:  # the parent `ftctl train` reports it, in train.log too
        if not report_worker_error(rank, exc):
            print(f"ftctl: error (rank {rank}): {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # the parent decides: a peer's death explains it, or its traceback is printed
        if args.debug or not report_worker_error(rank, exc):
            raise
        return 1
    if rank == 0:
        print(done_line(result), flush=True)
    return 0


def train_under_launcher(cfg, debug: bool = False):
    """Train one rank in this process; rank 0 prepares the run dir and every rank trains its config.

    Returns the TrainResult on rank 0 and None on the others.
    """
    import torch.distributed as dist

    from ftctl.config.compose import load_resolved, to_yaml
    from ftctl.parallel.distributed import ensure_process_group
    from ftctl.parallel.place import process_place
    from ftctl.training.run_dir import prepare_run_dir

    place = process_place()
    if cfg.parallel.name == "single" and place.world_size > 1:
        raise ConfigError(f"parallel=single, but the launcher started {place.world_size} ranks; choose ddp, fsdp, zero1/2/3 or mesh")
    owns_group = ensure_process_group(cfg.parallel.dist_backend, cfg.parallel.master_port)
    try:
        shared = [None]
        if place.rank == 0:
            try:
                run_dir = prepare_run_dir(cfg)
                shared = [{"run_dir": str(run_dir), "config": to_yaml(cfg)}]
            except FtctlError as exc:
                shared = [{"error": str(exc), "type": type(exc).__name__}]
        # Every rank trains rank 0's resolved config: an interpolated output_dir may differ per process.
        dist.broadcast_object_list(shared, src=0)
        answer = shared[0]
        if "error" in answer:
            raise (ConfigError if answer["type"] == "ConfigError" else FtctlError)(answer["error"])
        run_dir = Path(answer["run_dir"])
        if place.rank != 0:
            with tempfile.NamedTemporaryFile("w", suffix=".yaml") as copy:
                copy.write(answer["config"])
                copy.flush()
                cfg = load_resolved(copy.name)
        _setup_rank_logging(place.rank, run_dir, debug)
        from ftctl.training.runner import train

        try:
            result = train(cfg, run_dir)
        except BaseException as exc:  # whatever stopped it, as `ftctl train` does without a launcher
            if place.rank == 0:  # the run dir is rank 0's
                from ftctl.training.run_dir import end_failed_run

                end_failed_run(run_dir, exc)
            raise
        finally:
            if place.rank == 0:
                from ftctl.training.run_dir import finish_run_dir

                finish_run_dir(run_dir)
        return result if place.rank == 0 else None
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
