"""Experiment trackers behind one interface: TensorBoard, Weights & Biases, MLflow (``train.report_to``).

Every numeric field of every metrics line goes to each tracker under one naming (``train/loss``,
``eval/eval_loss``). Only the main rank opens trackers. Each tracker keeps its files in the run dir
and the id of its run in ``trackers.json``, so a resumed run continues the same tracker run.
Nothing here imports torch or a tracker's package at module level: the CLI checks the names
(:data:`TRACKER_PACKAGES`) before anything loads.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path
from typing import Dict, List, Optional
from urllib.parse import urlparse

log = logging.getLogger("ftctl")

#: Tracker name -> the Python module it needs (installed by the `track` extra, TensorBoard always).
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
IDS_FILE = "trackers.json"
PROJECT = "ftctl"  # W&B project and MLflow experiment unless WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME say otherwise


def metric_name(key: str) -> str:
    """The name a metrics-line key gets in every tracker."""
    if "/" in key:
        return key
    return f"eval/{key}" if key.startswith("eval") else f"train/{key}"


def numeric_values(record: dict) -> Dict[str, float]:
    """The numeric fields of a metrics line (but its step), under their tracker names."""
    return {metric_name(k): float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def requested_trackers(train_cfg) -> List[str]:
    """``train.report_to``, less TensorBoard when the deprecated ``train.tensorboard=false`` asks for that."""
    return [name for name in train_cfg.report_to if name != "tensorboard" or train_cfg.tensorboard]


def missing_packages(names: List[str]) -> List[str]:
    import importlib.util

    return [name for name in names if importlib.util.find_spec(TRACKER_PACKAGES[name]) is None]


class Tracker:
    """One tracker's run: receives each metrics line's numeric values, then is closed once."""

    name = ""

    def log(self, step: int, values: Dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: Path, run_name: str, params: dict, run_id: Optional[str]):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"))
        self.run_id = None

    def log(self, step, values):
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def close(self):
        self._writer.close()


def wandb_mode() -> str:
    """WANDB_MODE when set; otherwise online only with credentials and a reachable server, else offline."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc")).expanduser()
    has_key = bool(os.environ.get("WANDB_API_KEY")) or (netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"))
    if not has_key:
        return "offline"
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:  # a second at most: the run must not wait on a network that is not there
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=1.0).close()
        return "online"
    except OSError:
        return "offline"


class WandbTracker(Tracker):
    """Offline when there is no network: the run stays in <run dir>/wandb/ for `wandb sync` later."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, params: dict, run_id: Optional[str]):
        os.environ.setdefault("WANDB_SILENT", "true")  # its banner and sync hints would interleave with ftctl's lines
        import wandb

        mode = wandb_mode()
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, dir=str(run_dir), config=params,
            mode=mode, id=run_id, resume="allow" if run_id else None, reinit="create_new",
        )
        self.run_id = self._run.id
        where = f"offline in {run_dir / 'wandb'} (upload later with `wandb sync`)" if mode == "offline" else self._run.url
        log.info("wandb: run %s, %s", self.run_id, where)

    def log(self, step, values):
        self._run.log(values, step=step)

    def close(self):
        self._run.finish()


def _mlflow_uri(run_dir: Path) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    # MLflow keeps its file store for local use but refuses it unless asked; ftctl asks for the run dir's own.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (run_dir / "mlruns").resolve().as_uri()


class MlflowTracker(Tracker):
    """MLFLOW_TRACKING_URI when set, else a file store in <run dir>/mlruns (`mlflow ui --backend-store-uri ...`)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, params: dict, run_id: Optional[str]):
        from mlflow.tracking import MlflowClient

        self.uri = _mlflow_uri(run_dir)
        self._client = MlflowClient(tracking_uri=self.uri)
        if run_id is None:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
            experiment = self._client.get_experiment_by_name(experiment_name)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(experiment_name)
            run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
            self._client.log_batch(run_id, params=self._params(params))
        else:
            self._client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        log.info("mlflow: run %s in %s", run_id, self.uri)

    @staticmethod
    def _params(params: dict):
        from mlflow.entities import Param

        return [Param(key, str(value)[:6000]) for key, value in params.items()]

    def log(self, step, values):
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self):
        self._client.set_terminated(self.run_id)


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


def open_trackers(names: List[str], run_dir: Path, params: dict) -> List[Tracker]:
    """Start (or, after a resume, continue) each named tracker's run; their run ids go to trackers.json."""
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.is_file() else {}
    opened = [TRACKERS[name](run_dir, run_dir.name, params, ids.get(name)) for name in names]
    ids.update({t.name: t.run_id for t in opened if t.run_id})
    if ids:
        ids_path.write_text(json.dumps(ids, indent=1) + "\n")
    return opened
