"""Evals during training: named eval sets, keep_best (best/), early stopping, and their record across a resume."""

from __future__ import annotations

import json
import logging
import math

import pytest

from ftctl.paths import samples_dir

CHAT_SET = f"{{chat: {{path: {samples_dir() / 'sharegpt_sample.jsonl'}, format: sharegpt, metric: perplexity}}, own: {samples_dir() / 'alpaca_sample.jsonl'}}}"


def _tensors(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_named_eval_sets_are_logged_each_and_agree_with_ftctl_eval(make_cfg, run_training, tmp_path, caplog):
    from ftctl.config.schema import EvalSet
    from ftctl.evaluation.evaluate import EvalRequest, request_from_overrides, run_eval
    from ftctl.training.trackers import numeric_values

    caplog.set_level(logging.INFO, logger="ftctl")
    result, metrics = run_training(make_cfg("train.max_steps=4", "train.eval_every=2", f"data.eval_sets={CHAT_SET}"))
    evals = [m for m in metrics if "eval/chat_loss" in m]
    assert [m["step"] for m in evals] == [2, 4]
    for line in evals:
        assert set(line) == {"step", "eval/chat_loss", "eval/chat_perplexity", "eval/own_loss"}
        assert line["eval/chat_perplexity"] == pytest.approx(math.exp(line["eval/chat_loss"]), rel=1e-6)
        assert set(numeric_values(line)) == {"eval/chat_loss", "eval/chat_perplexity", "eval/own_loss"}  # the trackers' names
    assert evals[0]["eval/own_loss"] != evals[1]["eval/own_loss"]
    assert result.last_eval_loss == pytest.approx(evals[-1]["eval/chat_loss"], rel=1e-7)
    assert "step 4: eval/chat_loss" in caplog.text and "32 in eval set chat, 64 in eval set own" in caplog.text
    # `ftctl eval` on the run scores the run's own named sets, each by its own metric (unless only harness= is asked).
    req = request_from_overrides([f"adapter={result.run_dir}"])
    assert req.data_path is None and list(req.eval_sets) == ["chat", "own"] and req.eval_sets["chat"].metric == "perplexity"
    assert request_from_overrides([f"adapter={result.run_dir}", "harness=some_task"]).eval_sets == {}
    # The last eval of the run is the loss `ftctl eval` measures on its result (perplexity's mean cross-entropy).
    summary = run_eval(EvalRequest(adapter=str(result.final_dir), output=str(tmp_path / "e"), metric="perplexity",
                                   eval_sets={"chat": EvalSet(path=str(samples_dir() / "sharegpt_sample.jsonl"), format="sharegpt")}))
    assert summary["sets"]["chat"]["perplexity"]["loss"] == pytest.approx(evals[-1]["eval/chat_loss"], rel=1e-4)


def test_keep_best_and_early_stopping(make_cfg, run_training, caplog):
    """No later eval can beat the first by 100 nats: best/ holds step 1's weights and the run stops two evals later,
    logging that step's train line too, checkpointing it, and still saving final/."""
    caplog.set_level(logging.INFO, logger="ftctl")
    cfg = make_cfg("train.max_steps=10", "train.eval_every=1", "train.save_every=1", "train.keep_last=0", "train.log_every=2", "data.eval_fraction=0.2",
                   "train.keep_best=true", "train.early_stopping_patience=2", "train.early_stopping_threshold=100")
    result, metrics = run_training(cfg)
    run = result.run_dir
    assert result.steps == 3 and max(m["step"] for m in metrics) == 3
    assert [m["step"] for m in metrics if "loss" in m] == [2, 3]  # step 3's window is logged though 3 % log_every != 0
    first = next(m["eval_loss"] for m in metrics if m["step"] == 1)
    best = json.loads((run / "best" / "best.json").read_text())
    assert best == {"step": 1, "metric": "eval_loss", "value": pytest.approx(first, rel=1e-6)}
    assert _same(_tensors(run / "best"), _tensors(run / "checkpoints" / "step-1"))
    assert not _same(_tensors(run / "best"), _tensors(run / "final"))
    assert (run / "checkpoints" / "step-3").is_dir() and (run / "final" / "adapter_config.json").is_file()
    assert "early stopping at step 3: eval_loss has not improved on" in caplog.text and "at step 1 for 2 evals" in caplog.text
    state = json.loads((run / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["best_so_far"] == {"metric": "eval_loss", "value": pytest.approx(first, rel=1e-6), "step": 1, "evals_without_improvement": 2}


def test_the_best_so_far_survives_an_extension(make_cfg, run_training):
    """Extended past step 3, the run keeps comparing with step 1's best and its count of evals without improvement."""
    settings = ["train.eval_every=1", "train.save_every=1", "data.eval_fraction=0.2", "train.keep_best=true",
                "train.early_stopping_patience=4", "train.early_stopping_threshold=100"]
    first, _ = run_training(make_cfg("train.max_steps=3", *settings))
    assert first.steps == 3  # two evals without improvement so far: no early stop
    best_weights = _tensors(first.run_dir / "best")
    extended, metrics = run_training(make_cfg("train.max_steps=8", *settings, "resume=auto"))
    assert extended.steps == 5  # steps 4 and 5 make four evals without improvement
    assert json.loads((first.run_dir / "best" / "best.json").read_text())["step"] == 1
    assert _same(_tensors(first.run_dir / "best"), best_weights)
    assert [m["step"] for m in metrics if "eval_loss" in m] == [1, 2, 3, 4, 5]


def test_best_so_far_record():
    """Lower is better by more than the threshold; a non-finite value never is; patience counts evals since the best."""
    from types import SimpleNamespace

    from ftctl.training.evals import BestSoFar

    def run(values, patience, threshold=0.0):
        best = BestSoFar(SimpleNamespace(best_metric="eval/x_loss", keep_best=True, early_stopping_patience=patience,
                                         early_stopping_threshold=threshold), "run", is_main=False)
        saved, stopped = [], None
        for step, value in enumerate(values, start=1):
            if best.observe(step, {"eval/x_loss": value}):
                stopped = step
            best.act(step, lambda directory, info: saved.append(info["step"]))
            if stopped:
                break
        return saved, stopped, best

    saved, stopped, best = run([3.0, 2.0, 2.5, math.nan, 1.0, 1.5, 1.6, 1.7, 0.5], patience=3)
    assert saved == [1, 2, 5] and stopped == 8 and (best.step, best.value) == (5, 1.0)
    saved, stopped, _ = run([3.0, 2.5, 2.3, 2.0], patience=0, threshold=0.6)  # better means below best - 0.6
    assert saved == [1, 3] and stopped is None
    saved, stopped, _ = run([math.inf, 5.0], patience=1)
    assert saved == [] and stopped == 1
