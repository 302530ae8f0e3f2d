"""Write the demo task: turn a shipping request into a JSON order (seeded, so the files never drift).

    python scripts/make_demo_task.py

The request is free text ("Could you send four grey lamps to Lyon?"); the answer is one JSON object
with fixed keys, the item in the singular and the quantity as a number:
{"item": "lamp", "quantity": 4, "colour": "grey", "city": "Lyon"}. A small chat model asked
to do this answers in its own style (a code fence, prose, "lamps", "four"), which a strict JSON
comparison scores as wrong; a short LoRA fine-tune teaches the exact format.

Writes data_formats/samples/demo/orders_{train,heldout}.{alpaca,sharegpt}.jsonl: the same examples
in both formats, the held-out split disjoint from the training split; and, for the preference demo
(`make demo-dpo`), orders_{train,heldout}.pairs.jsonl: the same requests as ranked Alpaca records whose
chosen answer is the correct order and whose rejected answer is a plausible wrong one (:data:`MISTAKES`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "data_formats" / "samples" / "demo"
SEED = 20240611
N_TRAIN, N_HELDOUT = 400, 50

INSTRUCTION = "Extract the order as JSON with keys item (singular), quantity (a number), colour and city."
ITEMS = [
    ("mug", "mugs"), ("lamp", "lamps"), ("chair", "chairs"), ("kettle", "kettles"), ("towel", "towels"),
    ("vase", "vases"), ("box", "boxes"), ("glass", "glasses"), ("shelf", "shelves"), ("candle", "candles"),
    ("pillow", "pillows"), ("basket", "baskets"), ("bottle", "bottles"), ("plate", "plates"), ("bowl", "bowls"),
    ("brush", "brushes"), ("clock", "clocks"), ("cup", "cups"), ("knife", "knives"), ("rug", "rugs"),
    ("jar", "jars"), ("tray", "trays"), ("bench", "benches"), ("mirror", "mirrors"),
]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "grey", "orange", "purple", "pink", "brown", "silver"]
CITIES = [
    "Oslo", "Lyon", "Austin", "Kyoto", "Cairo", "Dublin", "Lisbon", "Denver", "Madrid", "Nairobi", "Porto",
    "Seattle", "Vienna", "Krakow", "Perth", "Quito", "Boston", "Milan", "Hanoi", "Zurich", "Leeds", "Tunis",
    "Bergen", "Gdansk", "Osaka", "Lima", "Turin", "Bremen", "Dallas", "Malmo",
]
NUMBER_WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
TEMPLATES = [
    "Please ship {goods} to {city}.",
    "Could you send {goods} to {city}?",
    "I need {goods} delivered in {city}.",
    "Deliver {goods} to {city}, please.",
    "Order: {goods}, destination {city}.",
    "We would like {goods} sent to {city}.",
    "Our {city} shop needs {goods}.",
    "Ship to {city}: {goods}.",
    "Hi! {goods} for our office in {city}, thanks.",
    "Can we get {goods} to the {city} store by Friday?",
]


def make_example(rng: random.Random) -> dict:
    singular, plural = rng.choice(ITEMS)
    colour, city = rng.choice(COLOURS), rng.choice(CITIES)
    quantity = rng.randint(1, 12)
    if quantity == 1:
        amount = rng.choice(["a", "one", "1"])
    else:
        amount = NUMBER_WORDS[quantity - 1] if rng.random() < 0.5 else str(quantity)
    goods = f"{amount} {colour} {singular if quantity == 1 else plural}"
    template = rng.choice(TEMPLATES)
    if template.startswith("Hi! "):
        goods = goods[0].upper() + goods[1:]
    request = template.format(goods=goods, city=city)
    answer = json.dumps({"item": singular, "quantity": quantity, "colour": colour, "city": city})
    return {"instruction": INSTRUCTION, "input": request, "output": answer}


def as_sharegpt(row: dict) -> dict:
    return {"conversations": [
        {"from": "human", "value": f"{row['instruction']}\n\n{row['input']}"},
        {"from": "gpt", "value": row["output"]},
    ]}


def make_splits(seed: int = SEED, n_train: int = N_TRAIN, n_heldout: int = N_HELDOUT):
    """(train rows, held-out rows): distinct requests, none of the held-out ones seen in training."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n_train + n_heldout:
        row = make_example(rng)
        if row["input"] not in seen:
            seen.add(row["input"])
            rows.append(row)
    return rows[:n_train], rows[n_train:]


PLURALS = dict(ITEMS)
#: Mistakes a small chat model makes with this task and finds about as likely as the right answer (the
#: base SmolLM2-135M-Instruct prefers the right one in 56 %, 60 % and 48 % of held-out requests): the item
#: as the request says it, the colour folded into the item, the colour left out.
MISTAKES = ("plural_item", "colour_in_item", "colour_left_out")


def wrong_answer(row: dict, rng: random.Random) -> str:
    """A plausible wrong answer to ``row``: one of the :data:`MISTAKES`."""
    order = json.loads(row["output"])
    mistake = rng.choice(MISTAKES)
    if mistake == "plural_item":
        order["item"] = PLURALS[order["item"]]
    elif mistake == "colour_in_item":
        order["item"] = f"{order['colour']} {order['item']}"
    else:
        del order["colour"]
    return json.dumps(order)


def as_pair(row: dict, rng: random.Random) -> dict:
    return {"instruction": row["instruction"], "input": row["input"], "chosen": row["output"], "rejected": wrong_answer(row, rng)}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    train, heldout = make_splits()
    mistakes = random.Random(SEED + 1)  # its own stream: the SFT files above stay as they were
    for split, rows in (("train", train), ("heldout", heldout)):
        path = OUT / f"orders_{split}.pairs.jsonl"
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(as_pair(row, mistakes)) + "\n")
        print(f"wrote {len(rows)} preference pairs to {path}")
        for fmt, convert in (("alpaca", dict), ("sharegpt", as_sharegpt)):
            path = OUT / f"orders_{split}.{fmt}.jsonl"
            with open(path, "w") as f:
                for row in rows:
                    f.write(json.dumps(convert(row)) + "\n")
            print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
