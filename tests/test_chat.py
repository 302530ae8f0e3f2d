"""`ftctl chat` and `ftctl generate`: greedy by default and equal to the shared generate helper, history and
/reset in the interactive loop, one output per prompt, and every kind of model reference (dir, adapter, GGUF)."""

from __future__ import annotations

import io
import json
import shutil

import pytest

PROMPT = "Reverse the word: owl"


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    from ftctl.evaluation.evaluate import load_for_generation

    return load_for_generation(str(tiny_model_dir), None)


def greedy(lm, messages_list, max_new_tokens=12):
    from ftctl.evaluation.generation import generate

    return generate(*lm, messages_list, max_new_tokens)


def chat_once(capsys, *args) -> str:
    from ftctl.cli import main

    capsys.readouterr()
    assert main(["chat", *args]) == 0
    return capsys.readouterr().out


def test_one_shot_prompt_is_greedy_and_deterministic(tiny_model_dir, tiny_lm, capsys):
    first = chat_once(capsys, f"model={tiny_model_dir}", f"prompt={PROMPT}", "max_new_tokens=12")
    assert first == chat_once(capsys, f"model={tiny_model_dir}", f"prompt={PROMPT}", "max_new_tokens=12")
    expected = greedy(tiny_lm, [[{"role": "user", "content": PROMPT}]])[0]
    assert expected and first == expected + "\n"

    system = chat_once(capsys, f"model={tiny_model_dir}", f"prompt={PROMPT}", "max_new_tokens=12", "system=Answer in one word.")
    assert system == greedy(tiny_lm, [[{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": PROMPT}]])[0] + "\n"


def test_sampling_is_seeded(tiny_model_dir, capsys):
    args = (f"model={tiny_model_dir}", f"prompt={PROMPT}", "max_new_tokens=24", "temperature=1.0", "top_p=0.95")
    one = chat_once(capsys, *args, "seed=1")
    assert one == chat_once(capsys, *args, "seed=1")
    assert one != chat_once(capsys, *args, "seed=2")


def test_interactive_chat_keeps_history_and_resets(tiny_model_dir, monkeypatch, capsys):
    import ftctl.evaluation.generation as generation
    from ftctl.cli import main

    seen, replies = [], []
    real_generate = generation.generate

    def recording_generate(model, tokenizer, messages_list, *args, **kwargs):
        seen.append([dict(m) for m in messages_list[0]])
        result = real_generate(model, tokenizer, messages_list, *args, **kwargs)
        replies.append(result[0])
        return result

    monkeypatch.setattr(generation, "generate", recording_generate)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nhow are you\n/reset\nhow are you\n/exit\nnever asked\n"))
    capsys.readouterr()
    assert main(["chat", f"model={tiny_model_dir}", "max_new_tokens=8"]) == 0
    captured = capsys.readouterr()

    assert len(seen) == 3, "blank lines are skipped and nothing is read after /exit"
    assert seen[0] == [{"role": "user", "content": "hello"}]
    assert seen[1] == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": replies[0]},
                       {"role": "user", "content": "how are you"}]
    assert seen[2] == [{"role": "user", "content": "how are you"}], "/reset forgets the conversation"
    assert "(conversation cleared)" in captured.err
    assert captured.out == "".join(reply + "\n" for reply in replies), "stdout holds the answers and nothing else"


def test_history_is_trimmed_to_the_context(tiny_lm):
    from ftctl.chat import ChatSession, Decoding
    from ftctl.errors import FtctlError

    session = ChatSession(*tiny_lm, Decoding(max_new_tokens=4), system="Be brief.")
    session.context_limit = 60
    for _ in range(3):
        session.ask("tell me about the green cat")
    assert session.dropped >= 1 and session.messages[0]["role"] == "system"
    assert session.messages[-2]["content"] == "tell me about the green cat"
    with pytest.raises(FtctlError, match="does not fit the model's context of 60 tokens"):
        session.ask("word " * 80)
    assert session.messages[-1]["role"] == "assistant", "a refused message leaves the history as it was"


def test_generate_writes_one_output_per_prompt(tiny_model_dir, tiny_lm, tmp_path, capsys):
    from ftctl.cli import main

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": "q1", "prompt": PROMPT}, {"prompt": "Add 2 and 3", "meta": {"split": "dev"}},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out" / "answers.jsonl"
    assert main(["generate", f"model={tiny_model_dir}", f"input={prompts}", f"output={out}", "max_new_tokens=10", "batch_size=2"]) == 0
    assert "generated 3 answers" in capsys.readouterr().out
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["prompt"] for w in written] == [r["prompt"] for r in rows]
    messages = [[{"role": "user", "content": PROMPT}], [{"role": "user", "content": "Add 2 and 3"}], rows[2]["prompt"]]
    assert [w["messages"] for w in written] == messages
    assert [w["output"] for w in written] == greedy(tiny_lm, messages, 10)
    assert written[0]["source"].endswith("prompts.jsonl:1")
    assert written[0]["id"] == "q1" and written[1]["meta"] == {"split": "dev"}  # the records' own fields pass through

    # Records of a data format: the prompt part is answered, the answer is kept as the reference.
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text(json.dumps({"instruction": "Add.", "input": "1 + 2", "output": "3"}) + "\n"
                      + json.dumps({"instruction": "Say hi.", "output": "hi"}) + "\n")
    assert main(["generate", f"model={tiny_model_dir}", f"input={alpaca}", f"output={out}", "max_new_tokens=6"]) == 1
    assert "exists; choose another file or pass overwrite=true" in capsys.readouterr().err
    assert main(["generate", f"model={tiny_model_dir}", f"input={alpaca}", f"output={out}", "max_new_tokens=6",
                 "system=Be terse.", "overwrite=true"]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["reference"] for w in written] == ["3", "hi"]
    assert written[0]["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Add.\n\n1 + 2"}]
    assert [w["output"] for w in written] == greedy(tiny_lm, [w["messages"] for w in written], 6)
    assert not list(out.parent.glob(".*partial*"))


def test_chat_runs_an_adapter_and_an_exported_gguf(tiny_model_dir, tiny_lm, tmp_path, capsys):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ftctl.export.gguf_writer import write_gguf

    # An adapter dir as training writes one (adapter_config.json naming the base), with non-zero B so it changes answers.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    peft_model.save_pretrained(tmp_path / "adapter")
    tiny_lm[1].save_pretrained(tmp_path / "adapter")
    peft_model.eval()
    messages = [[{"role": "user", "content": PROMPT}]]
    with_adapter = greedy((peft_model, tiny_lm[1]), messages)[0]
    assert with_adapter != greedy(tiny_lm, messages)[0], "the adapter changes the answer"
    assert chat_once(capsys, f"model={tmp_path / 'adapter'}", f"prompt={PROMPT}", "max_new_tokens=12") == with_adapter + "\n"
    assert chat_once(capsys, f"model={tiny_model_dir}", f"adapter={tmp_path / 'adapter'}", f"prompt={PROMPT}",
                     "max_new_tokens=12") == with_adapter + "\n"

    # A run dir stands for its final/, as the base of an adapter too.
    shutil.copytree(tiny_model_dir, tmp_path / "full-run" / "final")
    assert chat_once(capsys, f"model={tmp_path / 'full-run'}", f"adapter={tmp_path / 'adapter'}", f"prompt={PROMPT}",
                     "max_new_tokens=12") == with_adapter + "\n"

    gguf_file = write_gguf(tiny_lm[0], tiny_lm[1], tmp_path / "tiny.gguf", "f32")
    assert chat_once(capsys, f"model={gguf_file}", f"prompt={PROMPT}", "max_new_tokens=12") == greedy(tiny_lm, messages)[0] + "\n"


@pytest.mark.parametrize(
    "command, args, message",
    [
        ("chat", ["prompt=hi"], "say which model to run: model="),
        ("chat", ["model=m", "temprature=1"], "unknown chat option 'temprature'. Did you mean 'temperature'?"),
        ("chat", ["model=m", "temperature=hot"], "temperature=hot: expected a number"),
        ("chat", ["model=m", "top_p=1.5"], "top_p=1.5: must be between 0.0 and 1.0"),
        ("chat", ["model=m", "max_new_tokens=0"], "max_new_tokens=0: must be at least 1"),
        ("chat", ["model=/nonexistent/x.gguf", "prompt=hi"], "no such GGUF file"),
        ("chat", ["model=/nonexistent/dir", "prompt=hi"], "ftctl: error: model=/nonexistent/dir: no such dir, alias or hub id"),
        ("chat", ["model=m", "chat_template={% if %}", "prompt=hi"], "chat_template is not a valid Jinja template"),
        ("generate", ["model=m", "input=a.jsonl"], "generate needs output=FILE"),
        ("generate", ["model=m", "input=/nonexistent.jsonl", "output=/tmp/ftctl-never.jsonl"], "data file not found"),
    ],
)
def test_chat_and_generate_arguments_are_checked(command, args, message, capsys):
    from ftctl.cli import main

    assert main([command, *args]) != 0
    err = capsys.readouterr().err
    assert message in err and err.startswith("ftctl: error:") and "Traceback" not in err


def test_an_answer_ends_at_the_templates_end_of_turn_even_when_eos_differs(tiny_lm, monkeypatch):
    """Generation stops at the chat template's end-of-turn marker (here <|im_end|> with EOS made another
    token, as in Llama-3 models whose answers end in <|eot_id|>), not only at EOS: the text after it is cut."""
    import copy

    import torch

    from ftctl.evaluation.generation import answer_stops, generate

    model, tokenizer = tiny_lm[0], copy.deepcopy(tiny_lm[1])
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.eos_token = "<pad>"
    monkeypatch.setattr(model.generation_config, "eos_token_id", tokenizer.pad_token_id)
    assert set(answer_stops(model, tokenizer)) == {tokenizer.pad_token_id, end_of_turn}
    hello, more = tokenizer.encode("hello", add_special_tokens=False), tokenizer.encode(" more", add_special_tokens=False)
    seen = {}

    def scripted(input_ids, eos_token_id, **_):  # an answer that goes on past its end of turn
        seen["stops"] = eos_token_id
        tail = torch.tensor([hello + [end_of_turn] + more] * input_ids.shape[0])
        return torch.cat([input_ids, tail], dim=1)

    monkeypatch.setattr(model, "generate", scripted)
    assert generate(model, tokenizer, [[{"role": "user", "content": "hi"}]]) == ["hello"]
    assert end_of_turn in seen["stops"]
