"""Builds the micro-batches of the coming steps on a background thread while the current step computes.

Which examples a step trains on depends on the step alone (:class:`ftctl.data.batching.StepSampler`),
so the steps ahead can be laid out before they run: collating, packing and, for a GPU, copying into
page-locked memory (from which the copy to the device runs asynchronously, ``non_blocking=True``)
happen while the device works on the step before. The batches are the ones the loop would build
itself, in the same order.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator, List, Tuple


class StepBatches:
    """Iterates ``(step, micro-batches)`` over ``steps``, built ``depth`` steps ahead by ``build(step)``."""

    def __init__(self, build: Callable[[int], List], steps: range, *, pin_memory: bool = False, depth: int = 2):
        self._build, self._steps, self._pin = build, steps, pin_memory
        self._queue: "queue.Queue" = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="ftctl-batches", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            for step in self._steps:
                batches = self._build(step)
                if self._pin:
                    batches = batches.pinned() if hasattr(batches, "pinned") else [batch.pinned() for batch in batches]
                if not self._put((step, batches, None)):
                    return
        except BaseException as exc:  # handed to the training loop, which raises it where it stands
            self._put((None, None, exc))
            return
        self._put(None)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[Tuple[int, List]]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, batches, error = item
            if error is not None:
                raise error
            yield step, batches

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> "StepBatches":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
