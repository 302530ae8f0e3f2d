"""Recipes compose and validate; mistakes give one message naming the key and the nearest valid one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ftctl.config.compose import compose_config, group_options, list_recipes, load_resolved, to_yaml
from ftctl.errors import ConfigError


@pytest.mark.parametrize("recipe", group_options("recipe"))
def test_every_recipe_composes_and_validates(recipe, tmp_path, capsys):
    """Each recipe composes, and estimate and --dry-run answer from its shipped architecture, without weights."""
    from ftctl.cli import main
    from ftctl.estimate import estimate_for

    from ftctl.paths import recipes_dir

    cfg = compose_config([f"recipe={recipe}", "precision=bf16"])  # a plan for a GPU, whatever this machine is
    assert cfg.model.name_or_path
    # The random tiny model trains only under a recipe that names it (recipes/config.yaml names no model).
    names_tiny = "override /model: tiny_llama" in (recipes_dir() / "recipe" / f"{recipe}.yaml").read_text()
    assert (cfg.model.name_or_path == "tiny-llama") == names_tiny
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0
    estimate = estimate_for(cfg)
    assert estimate.parameters > estimate.trainable_parameters > 0 or cfg.method.name == "full"
    assert estimate.total_bytes > estimate.weights_bytes > 0
    assert main(["train", f"recipe={recipe}", "precision=bf16", f"output_dir={tmp_path / 'run'}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "plan (dry run" in out and "memory per rank" in out
    assert not (tmp_path / "run").exists()


def _chosen(cfg, group):
    """What a group option sets that tells it apart from the others of its group."""
    if group == "model":
        return cfg.model.config_file or cfg.model.name_or_path
    if group == "data":
        return cfg.data.path
    if group == "parallel" and cfg.parallel.name == "mesh":  # the mesh presets differ by their axes
        p = cfg.parallel
        return f"mesh pp={p.pp_size} tp={p.tp_size} ep={p.ep_size} dp_shard={p.dp_shard_size} dp_replicate={p.dp_replicate_size}"
    return getattr(cfg, group).name


#: Data options that hold preference data compose with an objective that reads it.
PREFERENCE_DATA = {"preference_sample": "objective=dpo", "kto_sample": "objective=kto"}


@pytest.mark.parametrize("group", ["model", "method", "parallel", "precision", "data", "objective"])
def test_every_group_option_composes(group):
    chosen = {}
    for option in group_options(group):
        overrides = ["recipe=tiny_lora", f"{group}={option}"]  # the group choice wins over the recipe's
        mesh_preset = group == "parallel" and option in ("tp", "pp", "fsdp_tp", "3d")  # their own process counts
        if group == "parallel" and option != "single" and not mesh_preset:
            overrides.append("parallel.nproc_per_node=2")
        if group == "data" and option in PREFERENCE_DATA:
            overrides.append(PREFERENCE_DATA[option])
        cfg = compose_config(overrides)
        chosen[option] = _chosen(cfg, group)
        if group in ("method", "parallel", "precision", "objective") and not mesh_preset:
            assert chosen[option] == option or option == "mesh" and chosen[option].startswith("mesh")  # the option file names what it selects
    assert len(set(chosen.values())) == len(chosen), f"two {group} options select the same thing: {chosen}"


def test_no_model_and_no_data_unless_named(capsys):
    """ftctl chooses neither for a run: without them it refuses in one line (and test_every_recipe_composes_and_validates
    checks that the tiny random model trains only under a recipe that names it)."""
    from ftctl.cli import main
    from ftctl.models.aliases import aliases

    assert main(["train", "data.path=mine.jsonl", "--cfg"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ftctl: error: no model: set model.name_or_path=") and err.count("\n") == 1
    assert all(name in err for name in aliases()) and "`ftctl models`" in err and "recipe=NAME" in err
    assert main(["train", "model.name_or_path=smollm2-135m-instruct", "--cfg"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ftctl: error: data.path has no value") and err.count("\n") == 1


def test_recipe_list_has_command_and_description():
    recipes = {r["name"]: r for r in list_recipes()}
    assert "tiny_lora" in recipes
    for name, r in recipes.items():
        assert r["command"].startswith(f"ftctl train recipe={name}"), r
        assert r["description"], f"recipe {name} has no one-line description comment"


def test_group_override_after_recipe_wins():
    cfg = compose_config(["recipe=tiny_lora", "method=full", "train.lr=1e-5"])
    assert cfg.method.name == "full"
    assert cfg.train.lr == 1e-5
    assert cfg.train.max_steps == 30  # still the recipe's


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lrr=3", "unknown config key 'train.lrr'. Did you mean 'train.lr'?"),
        ("trian.lr=3", "Did you mean 'train.lr'?"),
        ("method.rank=4", "Did you mean 'method.r'?"),
        ("train.lr=abc", "config key 'train.lr': expected float, got 'abc'"),
        ("train.max_steps=2.5", "config key 'train.max_steps': expected integer"),
        ("method=lorra", "unknown method 'lorra'. Did you mean 'lora'?"),
        ("recipe=tiny_lor", "unknown recipe 'tiny_lor'. Did you mean 'tiny_lora'?"),
        ("train.lr=0", "train.lr=0.0 must be > 0"),
        ("method.r=0", "method.r=0 must be > 0"),
        ("data.eval_fraction=1.0", "data.eval_fraction=1.0 must be in [0, 1)"),
        ("data.max_seq_len=4", "data.max_seq_len=4 is too small"),
        ("train.global_batch_size=6", "must be a multiple of train.micro_batch_size"),
        ("train.lr", "write key=value"),
        ("train.learning_rate=1e-4", "unknown config key 'train.learning_rate'. ftctl's name for it: train.lr."),
        ("lora_r=8", "ftctl's name for it: method.r."),
        ("lr=1e-4", "unknown config key 'lr'. Did you mean 'train.lr'?"),
        ("bf16=true", "ftctl's name for it: precision=bf16."),
    ],
)
def test_bad_overrides_give_one_clear_message(override, expected):
    with pytest.raises(ConfigError) as info:
        compose_config(["recipe=tiny_lora", override])
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_a_list_key_takes_one_name_or_a_comma_separated_list():
    assert compose_config(["recipe=tiny_lora", "method.target_modules=q_proj"]).method.target_modules == ["q_proj"]
    assert compose_config(["recipe=tiny_lora", "method.target_modules=q_proj,v_proj"]).method.target_modules == ["q_proj", "v_proj"]
    assert compose_config(["recipe=tiny_lora", "method.target_modules=[k_proj]"]).method.target_modules == ["k_proj"]
    linked = compose_config(["recipe=tiny_lora", "method.target_modules=q_proj", "method.modules_to_save=${method.target_modules}"])
    assert linked.method.modules_to_save == ["q_proj"]  # an interpolation is left for OmegaConf to resolve


def test_chat_templates_are_parsed_as_transformers_parses_them():
    from ftctl.config.validate import check_chat_template

    check_chat_template("data.chat_template", "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
                                              "{% if loop.last %}{% break %}{% endif %}{% endfor %}")
    with pytest.raises(ConfigError, match="not a valid Jinja template"):
        check_chat_template("data.chat_template", "{% for m in messages %}")


def test_unknown_key_in_a_recipe_file_names_the_key(tmp_path, monkeypatch):
    import shutil

    import ftctl.config.compose as compose

    tree = tmp_path / "recipes"
    shutil.copytree(compose.recipes_dir(), tree)
    (tree / "recipe" / "broken.yaml").write_text(
        "# ftctl train recipe=broken\n# a recipe with a typo\ntrain:\n  max_stpes: 3\n"
    )
    monkeypatch.setattr(compose, "recipes_dir", lambda: tree)
    with pytest.raises(ConfigError, match="max_stpes.*Did you mean 'train.max_steps'"):
        compose_config(["recipe=broken"])


def test_resolved_config_round_trips(tmp_path):
    cfg = compose_config(["recipe=tiny_lora", f"output_dir={tmp_path}/run", "seed=7"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert "${" not in path.read_text()  # interpolations resolved once, in the parent
    assert load_resolved(path) == cfg


def test_cli_cfg_prints_config_and_errors_are_messages(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "ftctl", "train", "recipe=tiny_lora", "seed=3", "--cfg"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "seed: 3" in ok.stdout and "name: lora" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "ftctl", "train", "train.lrr=1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "ftctl: error: unknown config key 'train.lrr'. Did you mean 'train.lr'? (`ftctl config-docs` lists every key)"
    )
    assert "Traceback" not in bad.stderr
    listing = subprocess.run([sys.executable, "-m", "ftctl", "recipes"], capture_output=True, text=True, timeout=120)
    assert "tiny_lora" in listing.stdout
