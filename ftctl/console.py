"""What ftctl prints and logs, shared by the CLI and every worker process: the `[ftctl]` log on stdout,
the run's train.log, the result line, and the libraries' notices a user cannot act on kept out."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Optional

from ftctl.errors import FtctlError


class _CurrentStdoutHandler(logging.StreamHandler):
    """Writes to sys.stdout as it is at each message: in-process callers (tests) replace and close it."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value):
        pass


class _RunLogHandler(logging.FileHandler):
    """train.log: when the disk fails under it, it stops writing quietly (logging would print a traceback for
    every line); the run's own error names the fault."""

    failed = False

    def emit(self, record):
        if not self.failed:
            super().emit(record)

    def handleError(self, record):
        self.failed = True

    def flush(self):
        try:
            super().flush()
        except OSError:
            self.failed = True

    def close(self):
        try:
            super().close()
        except OSError:
            self.failed = True


def setup_logging(run_dir=None, debug: bool = False) -> None:
    logger = logging.getLogger("ftctl")
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    logger.propagate = False
    if not any(isinstance(h, logging.StreamHandler) and getattr(h, "_ftctl", False) for h in logger.handlers):
        handler = _CurrentStdoutHandler()
        handler.setFormatter(logging.Formatter("[ftctl] %(message)s"))
        handler._ftctl = True
        logger.addHandler(handler)
    close_run_log()
    if run_dir is not None:
        file_handler = _RunLogHandler(run_dir / "train.log")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        file_handler._ftctl_run_log = True
        logger.addHandler(file_handler)


def close_run_log(ending: Optional[BaseException] = None) -> None:
    """Close the run dir's train.log; ``ending`` (what stopped the run) is written into it first."""
    logger = logging.getLogger("ftctl")
    for handler in [h for h in logger.handlers if getattr(h, "_ftctl_run_log", False)]:
        if ending is not None:
            reason = str(ending) if isinstance(ending, FtctlError) else f"{type(ending).__name__}: {ending}"
            handler.emit(logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "stopped: %s", (reason,), None))
        logger.removeHandler(handler)
        handler.close()


def done_line(result) -> str:
    eval_part = f", eval loss {result.last_eval_loss:.4f}" if result.last_eval_loss is not None else ""
    return f"done: {result.steps} steps, final loss {result.last_loss:.4f}{eval_part} -> {result.final_dir}"


def _not_the_cpu_accelerator_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Setting accelerator to CPU")


def _not_the_missing_kernels_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


def quiet_libraries(debug: bool) -> None:
    """What the libraries print that a user cannot act on stays out of ftctl's output (the CLI and every worker)."""
    # ftctl reports its own progress; the libraries' per-file bars would bury it.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # transformers asks DeepSpeed about ZeRO-3 whenever it saves a model, and on a machine without a GPU
    # DeepSpeed then warns it is "setting accelerator to CPU", in runs that use no DeepSpeed at all.
    logging.getLogger("DeepSpeed").addFilter(_not_the_cpu_accelerator_notice)  # DeepSpeed's own logger; adding twice is a no-op
    # bitsandbytes, imported by peft in every adapter run, looks on avx512_bf16 CPUs for an optional
    # hub kernel package ("kernels") and says so when it is absent; its own 4-bit CPU path works without it.
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_the_missing_kernels_notice)
    if not debug:  # deprecation notices between transformers and peft are not the user's to act on
        warnings.filterwarnings("ignore", category=FutureWarning)
