"""Progress bars for every command that takes more than a few seconds, on stderr, under one rule.

Shown when stderr is a terminal; ``FTCTL_PROGRESS=0`` (or ``--no-progress`` on any command) turns
them off and ``FTCTL_PROGRESS=1`` forces them on (a CI log that wants them). The train bar also
needs ``train.progress_bar``.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

ENV = "FTCTL_PROGRESS"


def progress_enabled() -> bool:
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    return sys.stderr.isatty()


def progress_bar(total: int, desc: str, unit: str = "it", initial: int = 0):
    """A tqdm bar on stderr, disabled (a no-op) where :func:`progress_enabled` says so."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=not progress_enabled())


def progress_iter(iterable, desc: str, unit: str = "it"):
    """``iterable`` wrapped in a bar of its length (cleared when done) under the same rule."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False, disable=not progress_enabled())


@contextmanager
def stages(desc: str, names: Sequence[str]) -> Iterator[Callable[[str], None]]:
    """A bar over the named stages of a task whose parts report no progress of their own (load, merge, write).

    ``stage(name)`` completes the previous stage and shows ``name`` as running.
    """
    bar = progress_bar(len(names), desc, unit="stage")
    started = []

    def stage(name: str) -> None:
        if started:
            bar.update(1)
        started.append(name)
        bar.set_postfix_str(name)

    try:
        yield stage
        if started:
            bar.update(1)
            bar.set_postfix_str("done")
    finally:
        bar.close()


@contextmanager
def library_bars_follow_rule() -> Iterator[None]:
    """Within the block, every tqdm bar a library opens (lm-eval, datasets) is off where :func:`progress_enabled`
    says so; libraries pass ``disable=`` themselves, so only the class's own constructor can overrule them."""
    if progress_enabled():
        yield
        return
    import tqdm.std

    original = tqdm.std.tqdm.__init__

    def quiet(self, *args, **kwargs):
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    tqdm.std.tqdm.__init__ = quiet
    try:
        yield
    finally:
        tqdm.std.tqdm.__init__ = original
