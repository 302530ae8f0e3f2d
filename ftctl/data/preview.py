"""`ftctl data preview`: rendered examples with trained spans marked, to check masking by eye."""

from __future__ import annotations

from ftctl.config.schema import PREFERENCE_OBJECTIVES, RunConfig
from ftctl.data.batching import sampler_for
from ftctl.data.dataset import build_datasets, mixture_summary
from ftctl.data.render import IGNORE_INDEX
from ftctl.data.sources import locate_all
from ftctl.data.template_tokens import add_template_tokens
from ftctl.models.loading import load_tokenizer, resolve_model_path

TRAINED_OPEN, TRAINED_CLOSE = "\u27e6", "\u27e7"  # ⟦trained⟧
GREEN, RESET = "\033[32m", "\033[0m"


def mark_spans(tokenizer, input_ids, labels, color: bool = False) -> str:
    """The decoded example with each run of trained tokens wrapped in ⟦ ⟧ (or green on a terminal)."""
    out, run, trained = [], [], None

    def flush():
        if run:
            text = tokenizer.decode(run, skip_special_tokens=False)
            if trained:
                text = f"{GREEN}{text}{RESET}" if color else f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}"
            out.append(text)

    for position, (token, label) in enumerate(zip(input_ids, labels)):
        # The first token is never a target: nothing comes before it to predict it from.
        is_trained = position > 0 and int(label) != IGNORE_INDEX
        if is_trained != trained:
            flush()
            run, trained = [], is_trained
        run.append(int(token))
    flush()
    return "".join(out)


def preview(cfg: RunConfig, n: int, color: bool = False) -> None:
    locate_all(cfg.data)  # a missing file or an unreachable hub dataset is a message before the tokenizer loads
    tokenizer = load_tokenizer(cfg.model, resolve_model_path(cfg.model.name_or_path))
    add_template_tokens(tokenizer, cfg.data.chat_template, cfg.data.add_special_tokens)  # tokenized as the run will
    if cfg.objective.name in PREFERENCE_OBJECTIVES:
        return preview_preference(cfg, tokenizer, n, color)
    train, _ = build_datasets(cfg.data, tokenizer, cfg.seed)
    legend = f"{GREEN}green{RESET}" if color else f"{TRAINED_OPEN}…{TRAINED_CLOSE}"
    stats = train.stats
    if cfg.data.mixture:
        origin = f"a mixture of {mixture_summary(stats)}"
        # What the first steps train on, so every source shows.
        shown = sampler_for(train, max(n, 1), cfg.seed, cfg.data.shuffle).global_batch(0)[:n]
    else:
        detected = f"; data.format=auto: {stats['format_detected']}" if stats.get("format_detected") else ""
        origin = f"{cfg.data.path} (format {stats.get('format', cfg.data.format)}{detected})"
        shown = list(range(min(n, len(train))))
    print(f"{len(train)} examples from {origin}; {stats.get('truncated', 0)} truncated to "
          f"data.max_seq_len={cfg.data.max_seq_len}, {stats.get('dropped_no_trained_tokens', 0)} dropped with no trained token; "
          f"trained spans are {legend}, the rest is masked")
    for i in shown:
        ids, labels = train[i]
        trained = int((labels[1:] != IGNORE_INDEX).sum())
        print(f"\n--- example {i}: {len(ids)} tokens, {trained} trained ---")
        print(mark_spans(tokenizer, ids, labels, color))


def preview_preference(cfg: RunConfig, tokenizer, n: int, color: bool = False) -> None:
    """Both sides of each pair (KTO: each answer with its label), trained tokens marked."""
    from ftctl.data.preference import UNPAIRED, build_preference_datasets

    kind = UNPAIRED if cfg.objective.name == "kto" else "pairs"
    train, _ = build_preference_datasets(cfg.data, tokenizer, cfg.seed, kind)
    s = train.stats
    legend = f"{GREEN}green{RESET}" if color else f"{TRAINED_OPEN}…{TRAINED_CLOSE}"
    what = "KTO examples" if kind == UNPAIRED else "pairs"
    print(f"{len(train)} {what} from {cfg.data.path} (format {cfg.data.format}, objective={cfg.objective.name}); "
          f"{s.get('truncated', 0)} ({s.get('truncated_share', 0):.1%}) with an answer cut to data.max_seq_len={cfg.data.max_seq_len}, "
          f"{s.get('dropped_identical', 0)} dropped as identical, {s.get('dropped_empty', 0)} with an empty answer; "
          f"trained tokens are {legend}, the rest is masked")
    for i in range(min(n, len(train))):
        sides = ("chosen", "rejected") if kind != UNPAIRED else (("desirable" if train.desirable[i] else "undesirable"),)
        for side, (ids, labels) in zip(sides, train[i]):
            trained = int((labels[1:] != IGNORE_INDEX).sum())
            print(f"\n--- {'pair' if kind != UNPAIRED else 'example'} {i}, {side}: {len(ids)} tokens, {trained} trained ---")
            print(mark_spans(tokenizer, ids, labels, color))
