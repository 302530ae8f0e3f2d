"""Regenerate the small bundled samples in data_formats/samples (seeded, so the files never drift).

    python scripts/make_samples.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data_formats" / "samples"
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
ANIMALS = ["cat", "dog", "owl", "fox", "bee", "cow", "eel", "yak"]


def alpaca(rng: random.Random, n: int):
    rows = []
    for _ in range(n):
        kind = rng.choice(["add", "reverse", "plural", "colour"])
        if kind == "add":
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            rows.append({"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)})
        elif kind == "reverse":
            word = rng.choice(ANIMALS + COLOURS)
            rows.append({"instruction": "Reverse the word.", "input": word, "output": word[::-1]})
        elif kind == "plural":
            word = rng.choice(ANIMALS)
            rows.append({"instruction": f"Give the plural of '{word}'.", "input": "", "output": word + "s"})
        else:
            c, a = rng.choice(COLOURS), rng.choice(ANIMALS)
            rows.append({
                "system": "Answer with a JSON object.",
                "instruction": "Extract the colour and the animal.",
                "input": f"I saw a {c} {a} today.",
                "output": json.dumps({"colour": c, "animal": a}),
            })
    return rows


def sharegpt(rng: random.Random, n: int):
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        word = rng.choice(ANIMALS)
        turns = [{"from": "system", "value": "You are a terse assistant."}] if rng.random() < 0.5 else []
        turns += [
            {"from": "human", "value": f"What is {a} times {b}?"},
            {"from": "gpt", "value": str(a * b)},
            {"from": "human", "value": f"And the word '{word}' backwards?"},
            {"from": "gpt", "value": word[::-1]},
        ]
        rows.append({"conversations": turns})
    return rows


def preference_pairs(rng: random.Random, n: int):
    """{prompt, chosen, rejected}: the right answer and a plausible wrong one (samples/preference/, kept out of
    the tiny tokenizer's training text, which reads the top-level samples only)."""
    rows = []
    for _ in range(n):
        kind = rng.choice(["add", "reverse", "plural"])
        if kind == "add":
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            rows.append({"prompt": f"Add the two numbers: {a} + {b}", "chosen": str(a + b), "rejected": str(a + b + rng.choice([-2, -1, 1, 10]))})
        elif kind == "reverse":
            word = rng.choice(ANIMALS + COLOURS)
            rows.append({"prompt": f"Reverse the word: {word}", "chosen": word[::-1], "rejected": word})
        else:
            word = rng.choice(ANIMALS)
            rows.append({"prompt": f"Give the plural of '{word}'.", "chosen": word + "s", "rejected": word + "es"})
    return rows


def kto_examples(pairs):
    """KTO's unpaired form of the same data: each pair's answers as a desirable and an undesirable completion."""
    rows = []
    for i, pair in enumerate(pairs):
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"] if i % 3 else pair["rejected"], "label": bool(i % 3)})
    return rows


def write(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {path}")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)
    for name, rows in (("alpaca_sample.jsonl", alpaca(rng, 64)), ("sharegpt_sample.jsonl", sharegpt(rng, 32))):
        write(OUT / name, rows)
    pairs = preference_pairs(random.Random(4321), 64)
    write(OUT / "preference" / "pairs_sample.jsonl", pairs)
    write(OUT / "preference" / "kto_sample.jsonl", kto_examples(pairs))


if __name__ == "__main__":
    main()
