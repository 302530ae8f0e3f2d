"""A model named by its Hugging Face hub id: from the local cache or the network, or one line at once.

Without this, an unreachable hub costs a minute of transformers' retries and a screen of
``Name or service not known`` before its own error.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
from typing import Optional
from urllib.parse import urlparse

from ftctl.errors import FtctlError

log = logging.getLogger("ftctl")

#: Seconds the reachability probe may take, name lookup included.
PROBE_TIMEOUT_S = 1.5


def ensure_hub_model_available(repo_id: str, key: str) -> None:
    """Raise one FtctlError unless ``repo_id`` can load: from the hub, or from the local cache."""
    cached = _cached_config(repo_id)
    if offline_requested():
        if not cached:
            raise FtctlError(
                f"{key}={repo_id}: not in the local Hugging Face cache ({_cache_dir()}) and HF_HUB_OFFLINE is set; "
                f"download it where the hub is reachable (hf download {repo_id}), or pass a local model dir or alias (`ftctl models`)"
            )
        return
    host, port = _probe_address()
    if hub_reachable(host, port):
        return
    if cached:
        _go_offline()
        log.info("the Hugging Face hub (%s) is not reachable: %s loads from the local cache", host, repo_id)
        return
    raise FtctlError(
        f"{key}={repo_id}: the Hugging Face hub ({host}) cannot be reached and the model is not in the local cache "
        f"({_cache_dir()}); download it where there is network (hf download {repo_id}), or pass a local model dir or alias (`ftctl models`)"
    )


@functools.lru_cache(maxsize=None)
def hub_reachable(host: str, port: int) -> bool:
    """A TCP connection to the hub (or the proxy in front of it) within PROBE_TIMEOUT_S, name lookup included."""
    answer = []

    def probe() -> None:
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                answer.append(True)
        except OSError:
            answer.append(False)

    # A name lookup ignores the socket timeout, so the probe runs in a thread that is not waited for past it.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(PROBE_TIMEOUT_S)
    return bool(answer and answer[0])


def _probe_address():
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy if proxy else _endpoint())
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme != "http" else 80)


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def offline_requested(*more_variables: str) -> bool:
    """HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE (or one of ``more_variables``, e.g. HF_DATASETS_OFFLINE) is set."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", *more_variables)
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in names)


def hub_unreachable_reason(*more_offline_variables: str) -> Optional[str]:
    """Why the Hub cannot be used now ('HF_HUB_OFFLINE is set', 'no network'), or None; the probe is bounded
    in time and asked once per process."""
    if offline_requested(*more_offline_variables):
        return "HF_HUB_OFFLINE is set"
    host, port = _probe_address()
    return None if hub_reachable(host, port) else f"{host} is unreachable (no network)"


def _go_offline() -> None:
    """Load from the cache without trying the network again (this process and the workers it starts)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = True
    except ImportError:
        pass


def _cached_config(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id huggingface_hub refuses to parse is not in its cache
        return False


def _cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return constants.HF_HUB_CACHE
    except ImportError:
        return "~/.cache/huggingface/hub"
