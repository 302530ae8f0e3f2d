"""Size and perplexity of every GGUF quantisation ftctl writes, measured by llama.cpp itself on held-out data.

    python scripts/gguf_kquants.py [--model smollm2-135m-instruct] [--data FILE] [--out DIR] [--json FILE]

Each quantisation is written with `ftctl export` (f16 and q8_0 by ftctl, q6_k, q5_k_m and q4_k_m by
llama.cpp's own quantizer from ftctl's f16 file) and loaded by llama.cpp (llama-cpp-python). The
held-out records (default: the demo's 50 held-out orders) are rendered with the model's chat template,
as training and `ftctl eval` render them; perplexity is exp(mean negative log-likelihood) of every
token after the first, from llama.cpp's logits, each conversation on its own. The same figure from
transformers on the source model (fp32) is the reference. Against the f16 file, as llama.cpp's
`llama-perplexity --kl-divergence` reports it: the mean KL divergence of each file's next-token
distribution from f16's, and how often both pick the same top token. Each file also answers the first
held-out prompt greedily. This is a measurement, not a test: it takes minutes (--reuse keeps files
already written in --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QUANTS = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m")
#: llama.cpp's threads spin while they wait: on a shared machine more threads than free cores slow it down.
THREADS = int(os.environ.get("FTCTL_BENCH_THREADS", "1"))


def conversations(tokenizer, data: Path, fmt: str) -> list:
    from data_formats import get_format

    records = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    converter = get_format(fmt)
    rendered = []
    for record in records:
        messages = [{"role": m.role, "content": m.content} if hasattr(m, "role") else m for m in converter.to_messages(record)]
        rendered.append(messages)
    return rendered


def token_ids(tokenizer, messages: list, prompt_only: bool = False) -> list:
    if prompt_only:
        messages = [m for m in messages if m["role"] != "assistant"]
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=prompt_only)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def llama_cpp_perplexity(path: Path, sequences: list, baseline: list = None) -> dict:
    """Perplexity over ``sequences``; with ``baseline`` (f16's log-probabilities per sequence) also the mean KL
    divergence from it and the share of positions with the same top token. Without it, returns its own log-probabilities."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=THREADS, n_threads_batch=THREADS)
    try:
        nll, count, kl, same_top, kept = 0.0, 0, 0.0, 0, []
        for index, ids in enumerate(sequences):
            llm.reset()
            llm.eval(ids)
            logprobs = log_softmax(np.array(llm.scores[: len(ids) - 1], dtype=np.float64))
            nll -= float(logprobs[np.arange(len(ids) - 1), ids[1:]].sum())
            count += len(ids) - 1
            if baseline is None:
                kept.append(logprobs.astype(np.float32))
            else:
                reference = baseline[index].astype(np.float64)
                kl += float((np.exp(reference) * (reference - logprobs)).sum())
                same_top += int((reference.argmax(axis=1) == logprobs.argmax(axis=1)).sum())
        figures = {"perplexity": math.exp(nll / count), "tokens": count}
        if baseline is None:
            figures["logprobs"] = kept
        else:
            figures.update(kl_vs_f16=kl / count, same_top_vs_f16=same_top / count)
        return figures
    finally:
        llm.close()


def llama_cpp_answer(path: Path, prompt: list, tokenizer, max_tokens: int = 40) -> str:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=512, verbose=False, n_threads=THREADS, n_threads_batch=THREADS)
    try:
        out = []
        for token in llm.generate(prompt, temp=0.0, top_k=1):
            if token == tokenizer.eos_token_id or len(out) >= max_tokens:
                break
            out.append(token)
        return tokenizer.decode(out)
    finally:
        llm.close()


def transformers_perplexity(model_dir: Path, sequences: list) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids in sequences:
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
            nll -= float(torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
            count += len(ids) - 1
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="anything `ftctl export model=` takes")
    parser.add_argument("--data", type=Path, default=ROOT / "data_formats" / "samples" / "demo" / "orders_heldout.alpaca.jsonl")
    parser.add_argument("--format", default="alpaca")
    parser.add_argument("--out", type=Path, default=Path("runs/gguf_kquants"))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--reuse", action="store_true", help="measure files already in --out instead of writing them again")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from ftctl.export import ExportRequest, export_model
    from ftctl.models.loading import resolve_model_path

    model_dir = Path(resolve_model_path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = conversations(tokenizer, args.data, args.format)
    sequences = [token_ids(tokenizer, messages) for messages in records]
    prompt = token_ids(tokenizer, records[0], prompt_only=True)
    args.out.mkdir(parents=True, exist_ok=True)

    rows, baseline = [], None
    reference = transformers_perplexity(model_dir, sequences)
    for quant in QUANTS:  # f16 first: the others are compared with it
        path = args.out / f"{model_dir.name}-{quant}.gguf"
        seconds = None
        if not (args.reuse and path.is_file()):
            started = time.perf_counter()
            export_model(ExportRequest(model=args.model, format="gguf", output=str(path), quant=quant, overwrite=True))
            seconds = round(time.perf_counter() - started, 1)
        figures = llama_cpp_perplexity(path, sequences, baseline)
        baseline = figures.pop("logprobs", baseline)
        rows.append({"quant": quant, "bytes": path.stat().st_size, "export_s": seconds, **figures,
                     "answer": llama_cpp_answer(path, prompt, tokenizer)})
    f16 = rows[0]
    print(f"held-out: {args.data.name}, {len(sequences)} conversations, {f16['tokens']} scored tokens; "
          f"transformers fp32 perplexity {reference:.4f}")
    print("| gguf.quant | file MB | vs f16 size | perplexity (llama.cpp) | vs f16 | KL from f16 | same top token as f16 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['quant']} | {row['bytes'] / 1e6:.1f} | {row['bytes'] / f16['bytes']:.2f} | {row['perplexity']:.2f} | "
              f"{(row['perplexity'] / f16['perplexity'] - 1) * 100:+.1f} % | {row.get('kl_vs_f16', 0.0):.4f} | "
              f"{row.get('same_top_vs_f16', 1.0) * 100:.1f} % |")
    for row in rows:
        print(f"{row['quant']} answers the first held-out order: {row['answer']!r}")
    if args.json:
        args.json.write_text(json.dumps({"reference_perplexity": reference, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
