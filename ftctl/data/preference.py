"""Preference data for ``objective=dpo``, simpo, orpo and kto: tokenized once per side, batched side by side.

A pair's prompt and each of its two answers are rendered once, as one conversation per side, through
the chat template the run uses (:func:`ftctl.data.render.tokenize_conversation`, so named templates,
the EOS rule and exactly one BOS hold as in SFT); the trained tokens of a side are its answer after the
shared prompt, the answer's end-of-turn tokens included. Earlier assistant turns of a prompt are
context and never train. KTO's examples are one answer each, with a label.

**Truncation rule**: the prompt is kept whole and each answer is cut at its end, so that prompt +
answer fits ``data.max_seq_len``: both answers of a pair lose their tail the same way, and a pair
counts as truncated when either answer was cut (the share is logged and in every metrics line). A
prompt that leaves no room for an answer is an error naming the record.

**Dropped**: a pair whose answers are identical (as tokens, after truncation) or that has an empty
answer teaches nothing; such pairs are counted, dropped, and named in one log line. KTO drops examples
with an empty answer.

**KTO's KL estimate** needs answers that do not belong to their prompts: each example also stores its
prompt followed by the answer of the example half the data set away (``(i + N // 2) mod N``, so a pair
read as two KTO examples never meets its own prompt). Fixed per example, so the reference log-probs of
these sequences can be precomputed like any other.

Every example is two sequences, stored flat: pairs hold (chosen, rejected), KTO examples (answer, KL
sequence). :class:`PreferenceBatching` lays a micro-batch's sequences out padded or packed (the same
packed path as SFT) and records which sequence each trained position belongs to, so per-sequence
log-probs come out equal either way.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from data_formats import (
    AUTO, PAIRS, UNPAIRED, FormatError, LabelledAnswer, PreferencePair, detect_format, get_format, other_format_hint,
    with_system_prompt,
)
from ftctl.config.schema import DataConfig
from ftctl.data.batching import Batching, MicroBatch, StepShare, collate, pack_examples
from ftctl.data.dataset import first_record
from ftctl.data.records import Record, RecordLimit
from ftctl.data.render import IGNORE_INDEX, TemplateError, ensure_chat_template, tokenize_conversation
from ftctl.data.sources import DataSource, iter_source, locate
from ftctl.errors import FtctlError
from ftctl.paths import ftctl_home

log = logging.getLogger("ftctl")



@dataclass
class PreferenceDataset:
    """Examples of two sequences each: sequence j is ``input_ids[offsets[j]:offsets[j+1]]``; example i holds
    sequences 2i and 2i+1 (chosen and rejected; for KTO, the answer and its KL sequence)."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    truncated: np.ndarray  # per example: an answer was cut to fit data.max_seq_len
    desirable: Optional[np.ndarray] = None  # KTO: the label of each example; None for pairs
    stats: dict = field(default_factory=dict)
    #: The reference model's summed log-probability of each sequence, (examples, 2), once precomputed.
    reference_logps: Optional[np.ndarray] = None
    mixture = None  # the step sampler mixes sources only for SFT data

    @property
    def kind(self) -> str:
        return PAIRS if self.desirable is None else UNPAIRED

    def __len__(self) -> int:
        return (len(self.offsets) - 1) // 2

    def sequence(self, j: int) -> Tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[j], self.offsets[j + 1]
        return self.input_ids[a:b], self.labels[a:b]

    def __getitem__(self, i: int):
        return self.sequence(2 * i), self.sequence(2 * i + 1)

    def subset(self, indices) -> "PreferenceDataset":
        indices = list(indices)
        sequences = [j for i in indices for j in (2 * i, 2 * i + 1)]
        parts = [self.sequence(j) for j in sequences]
        offsets = np.concatenate([[0], np.cumsum([len(x) for x, _ in parts])]).astype(np.int64)
        return PreferenceDataset(
            np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts]), offsets,
            self.truncated[indices], None if self.desirable is None else self.desirable[indices], {},
            None if self.reference_logps is None else self.reference_logps[indices],
        )

    def trained_tokens(self) -> int:
        """Answer tokens that train: both sides of a pair; a KTO example's answer (its KL sequence only estimates)."""
        if self.desirable is None:
            return int((self.labels != IGNORE_INDEX).sum())
        return sum(int((self.sequence(2 * i)[1] != IGNORE_INDEX).sum()) for i in range(len(self)))

    @functools.cached_property
    def trained_per_example(self) -> np.ndarray:
        """Each example's trained tokens as its micro-batch counts them (after each sequence's first position):
        both sides of a pair; a KTO example's answer, not its KL sequence (scored apart, without gradients)."""
        trained = np.concatenate([[0], np.cumsum(self.labels != IGNORE_INDEX)])
        starts, ends = self.offsets[:-1], self.offsets[1:]
        per_sequence = (trained[ends] - trained[np.minimum(starts + 1, ends)]).reshape(-1, 2)
        return per_sequence[:, 0] if self.desirable is not None else per_sequence.sum(axis=1)

    def fingerprint(self) -> str:
        """Hash of the tokenized examples: what the reference log-probs are a function of (with the model)."""
        h = hashlib.sha256(self.kind.encode())
        for array in (self.input_ids, self.labels, self.offsets) + (() if self.desirable is None else (self.desirable,)):
            h.update(np.ascontiguousarray(array).tobytes())
        return h.hexdigest()


@dataclass
class _Rendered:
    prompt: List[int]
    answer: List[int]


def _render(prompt, answer: str, tokenizer, record: Record) -> _Rendered:
    """The prompt's tokens and the answer's (end-of-turn tokens included), from one rendering of the whole side."""
    try:
        example = tokenize_conversation(prompt + [{"role": "assistant", "content": answer}], tokenizer, max_seq_len=1 << 62)
    except TemplateError as exc:
        raise FtctlError(f"{record.source}: {exc}") from None
    start = next(i for i, label in enumerate(example.labels) if label != IGNORE_INDEX)
    return _Rendered(example.input_ids[:start], example.input_ids[start:])


def _fitted(prompt: List[int], answer: List[int], max_seq_len: int) -> Tuple[List[int], List[int], bool]:
    """(input_ids, labels, truncated) of prompt + answer, the answer's tail cut to fit (the truncation rule)."""
    room = max_seq_len - len(prompt)
    kept = answer[:room]
    return prompt + kept, [IGNORE_INDEX] * len(prompt) + kept, len(answer) > room


def _check_prompt_fits(prompt: List[int], max_seq_len: int, record: Record) -> None:
    if len(prompt) >= max_seq_len:
        raise FtctlError(
            f"{record.source}: the prompt is {len(prompt)} tokens, so data.max_seq_len={max_seq_len} leaves no room "
            "for an answer; raise data.max_seq_len (or shorten the prompt)"
        )


def detect_preference_format(record: Record, kind: str) -> Tuple[str, str]:
    """data.format=auto for a preference objective: (format, why) from the first record; KTO reads pairs too."""
    name, why = detect_format(record.data, kind)
    if kind == UNPAIRED and not why.startswith("its first record reads"):
        paired = detect_format(record.data, PAIRS)
        if paired[1].startswith("its first record reads"):
            return paired
    return name, why


def read_preference_records(records: Iterable[Record], data_format: str, kind: str) -> Iterator[Tuple[Record, object]]:
    """Each record as a :class:`PreferencePair` (``kind`` pairs) or as KTO's labelled answers (a pair gives two),
    one at a time."""
    fmt = get_format(data_format)
    for record in records:
        try:
            if kind == UNPAIRED and fmt.gives_unpaired:
                yield record, fmt.to_unpaired(record.data)
            elif kind == UNPAIRED:
                pair = fmt.to_pair(record.data)
                yield record, LabelledAnswer(pair.prompt, pair.chosen, True)
                yield record, LabelledAnswer(pair.prompt, pair.rejected, False)
            else:
                yield record, fmt.to_pair(record.data)
        except FormatError as exc:
            hint = other_format_hint(record.data, data_format)
            raise FtctlError(f"{record.source}: not a valid '{data_format}' record: {exc}.{hint}") from None


def tokenize_preference(records: Iterable[Record], source: DataSource, data_format: str, cfg: DataConfig, tokenizer,
                        kind: str, limit: Optional[RecordLimit] = None) -> PreferenceDataset:
    """Tokenize records as they come (a generator keeps one in memory; KTO keeps each answer's rendering until
    the KL partners are known); ``limit`` counts the records data.max_record_bytes skipped."""
    where = source.location if source.kind != "hub" else source.value
    first, records = first_record(records, source, limit)
    detected = None
    if data_format == AUTO:
        data_format, detected = detect_preference_format(first, kind)
    sequences: List[Tuple[List[int], List[int]]] = []
    truncated, desirable = [], []
    dropped = {"identical": 0, "empty": 0}
    rendered: List[Tuple[Record, _Rendered, bool]] = []  # KTO: (record, rendering, label), before KL partners
    for record, item in read_preference_records(records, data_format, kind):
        prompt = with_system_prompt(item.prompt, cfg.system_prompt)
        if isinstance(item, PreferencePair):
            if not item.chosen.strip() or not item.rejected.strip():
                dropped["empty"] += 1
                continue
            chosen, rejected = _render(prompt, item.chosen, tokenizer, record), _render(prompt, item.rejected, tokenizer, record)
            if chosen.prompt != rejected.prompt:  # one rendering of one prompt: a template that breaks this is wrong
                raise FtctlError(f"{record.source}: the chat template renders the prompt differently before the two answers")
            _check_prompt_fits(chosen.prompt, cfg.max_seq_len, record)
            chosen_ids, chosen_labels, chosen_cut = _fitted(chosen.prompt, chosen.answer, cfg.max_seq_len)
            rejected_ids, rejected_labels, rejected_cut = _fitted(rejected.prompt, rejected.answer, cfg.max_seq_len)
            if chosen_ids == rejected_ids:
                dropped["identical"] += 1
                continue
            sequences += [(chosen_ids, chosen_labels), (rejected_ids, rejected_labels)]
            truncated.append(chosen_cut or rejected_cut)
        else:
            if not item.answer.strip():
                dropped["empty"] += 1
                continue
            side = _render(prompt, item.answer, tokenizer, record)
            _check_prompt_fits(side.prompt, cfg.max_seq_len, record)
            rendered.append((record, side, item.desirable))
    if kind == UNPAIRED:
        n = len(rendered)
        for i, (record, side, label) in enumerate(rendered):
            partner = rendered[(i + max(1, n // 2)) % n][1]
            ids, labels, cut = _fitted(side.prompt, side.answer, cfg.max_seq_len)
            kl_ids, kl_labels, _ = _fitted(side.prompt, partner.answer, cfg.max_seq_len)
            sequences += [(ids, labels), (kl_ids, kl_labels)]
            truncated.append(cut)
            desirable.append(label)
    what = "pair" if kind == PAIRS else "example"
    if not truncated:
        raise FtctlError(f"{where}: every {what} was dropped ({dropped['identical']} with identical answers, "
                         f"{dropped['empty']} with an empty answer); nothing is left to train on")
    n = len(truncated)
    stats = {"examples": n, "kind": kind, "truncated": int(sum(truncated)), "truncated_share": sum(truncated) / n,
             "dropped_identical": dropped["identical"], "dropped_empty": dropped["empty"], "dropped_no_trained_tokens": 0,
             "source": source.describe(), "key": source.key, "format": data_format, "format_detected": detected}
    if limit is not None and limit.skipped:
        stats["skipped_too_long"] = limit.skipped
        stats["skipped_note"] = limit.summary()
    if kind == UNPAIRED:
        stats["desirable"] = int(sum(desirable))
    offsets = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in sequences])]).astype(np.int64)
    return PreferenceDataset(
        np.concatenate([np.asarray(ids, dtype=np.int32) for ids, _ in sequences]),
        np.concatenate([np.asarray(labels, dtype=np.int32) for _, labels in sequences]),
        offsets, np.asarray(truncated, dtype=bool), np.asarray(desirable, dtype=bool) if kind == UNPAIRED else None, stats,
    )


def _module_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def load_or_tokenize_preference(path: str | DataSource, cfg: DataConfig, tokenizer, kind: str, key: str = "data.path",
                                data_format: Optional[str] = None) -> PreferenceDataset:
    """Tokenize a preference source in ``data_format`` (default data.format), or reuse the cache entry keyed as
    SFT data is (content, tokenizer, settings, data.max_record_bytes) plus the kind."""
    from ftctl.data.dataset import _cache_key, write_cache

    source = path if isinstance(path, DataSource) else locate(str(path), key, cfg.split, cfg.subset)
    data_format = data_format or cfg.format
    cache_root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else ftctl_home() / "data_cache"
    name = hashlib.sha256(f"{_cache_key(source, data_format, cfg, tokenizer)}:{kind}:{_module_hash()}".encode()).hexdigest()[:24]
    entry = cache_root / f"preference-{name}.npz"
    if entry.is_file():
        with np.load(entry, allow_pickle=False) as z:
            data = PreferenceDataset(z["input_ids"], z["labels"], z["offsets"], z["truncated"],
                                     z["desirable"] if kind == UNPAIRED else None, json.loads(str(z["stats"])))
        data.stats["cache"] = "hit"
    else:
        limit = RecordLimit(cfg.max_record_bytes)
        data = tokenize_preference(iter_source(source, limit), source, data_format, cfg, tokenizer, kind, limit)
        write_cache(entry, data, truncated=data.truncated,
                    desirable=data.desirable if data.desirable is not None else np.zeros(0, dtype=bool))
    if data.stats.get("skipped_note"):
        log.warning("%s: %s", source.describe(), data.stats["skipped_note"])
    return data


def build_preference_datasets(cfg: DataConfig, tokenizer, seed: int, kind: str) -> Tuple[PreferenceDataset, Optional[PreferenceDataset]]:
    """The train split and the eval split (data.eval_path, a seeded data.eval_fraction, or none), as for SFT data."""
    from ftctl.data.dataset import _hold_out

    ensure_chat_template(tokenizer, cfg.chat_template)
    full = load_or_tokenize_preference(cfg.path, cfg, tokenizer, kind)
    if full.stats.get("dropped_identical") or full.stats.get("dropped_empty"):
        log.info("preference data: dropped %d %s with identical answers and %d with an empty answer",
                 full.stats.get("dropped_identical", 0), "pairs" if kind == PAIRS else "examples", full.stats.get("dropped_empty", 0))
    train, held_out = _hold_out(full, cfg.eval_fraction, seed)
    if cfg.eval_path:
        evaluation = locate(cfg.eval_path, "data.eval_path", cfg.eval_split, cfg.subset)
        return train, load_or_tokenize_preference(evaluation, cfg, tokenizer, kind)
    return train, held_out


def build_preference_eval_sets(cfg: DataConfig, tokenizer, kind: str) -> Dict[str, PreferenceDataset]:
    """The named eval sets of data.eval_sets as preference data, each in its own format."""
    from ftctl.config.eval_sets import named_eval_sets

    ensure_chat_template(tokenizer, cfg.chat_template)
    sets = {}
    for name, entry in named_eval_sets(cfg.eval_sets).items():
        source = locate(entry.path, f"data.eval_sets.{name}.path", entry.split or cfg.eval_split,
                        entry.subset if entry.subset is not None else cfg.subset)
        sets[name] = load_or_tokenize_preference(source, cfg, tokenizer, kind, data_format=entry.format or cfg.format)
    return sets


@dataclass
class PreferenceBatch(MicroBatch):
    """A micro-batch of preference sequences, with what is needed to score each sequence on its own."""

    loss_sequences: Optional["torch.Tensor"] = None  # noqa: F821  which sequence each of loss_positions belongs to
    sequence_tokens: Optional["torch.Tensor"] = None  # noqa: F821  trained (answer) tokens of each sequence, float32
    examples: int = 0  # pairs, or KTO examples
    truncated_examples: int = 0
    reference_logps: Optional["torch.Tensor"] = None  # noqa: F821  precomputed, one per sequence
    desirable: Optional["torch.Tensor"] = None  # noqa: F821  KTO: the label of each example
    kl: Optional["PreferenceBatch"] = None  # KTO: the examples' KL sequences, scored without gradients

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_tokens)


def sequence_of_positions(batch: MicroBatch, lengths: Sequence[int]) -> np.ndarray:
    """For every flattened position of ``batch``, the index of the sequence (example) it belongs to; -1 for padding."""
    rows, width = batch.input_ids.shape
    owner = np.full((rows, width), -1, dtype=np.int64)
    if batch.packed_rows is None:
        for r, length in enumerate(lengths):
            owner[r, :length] = r
    else:
        for r, row in enumerate(batch.packed_rows):
            start = 0
            for i in row:
                owner[r, start:start + lengths[i]] = i
                start += lengths[i]
    return owner.reshape(-1)


@dataclass(frozen=True)
class PreferenceBatching(Batching):
    """Micro-batches of ``micro_batch_size`` examples: a pair's two sequences side by side (chosen, rejected, chosen,
    ...), a KTO example's answer with its KL sequence in a separate no-gradient batch; padded or packed."""

    def step_share(self, dataset, sampler, step: int, rank: int, world_size: int) -> StepShare:
        """As for SFT, plus the step's units: the global batch's examples (a step's loss is their mean)."""
        share = super().step_share(dataset, sampler, step, rank, world_size)
        return replace(share, units=len(sampler.global_batch(step)))

    def __call__(self, dataset: PreferenceDataset, indices: Sequence[int]) -> List[PreferenceBatch]:
        out = []
        for j in range(0, len(indices), self.micro_batch_size):
            chunk = list(indices[j: j + self.micro_batch_size])
            if dataset.desirable is None:
                out.append(self.lay_out(dataset, [2 * i + side for i in chunk for side in (0, 1)], chunk))
            else:
                batch = self.lay_out(dataset, [2 * i for i in chunk], chunk)
                batch.kl = self.lay_out(dataset, [2 * i + 1 for i in chunk], chunk)
                out.append(batch)
        return out

    def lay_out(self, dataset: PreferenceDataset, sequence_ids: List[int], chunk: List[int]) -> PreferenceBatch:
        import torch

        examples = [dataset.sequence(j) for j in sequence_ids]
        if self.pack_to:
            base = pack_examples(examples, self.pack_to, self.pad_token_id, self.pad_to_multiple_of)
        else:
            base = collate(examples, self.pad_token_id, self.pad_to_multiple_of)
        owner = sequence_of_positions(base, [len(ids) for ids, _ in examples])
        reference = None
        if dataset.reference_logps is not None:
            reference = torch.from_numpy(dataset.reference_logps.reshape(-1)[sequence_ids].astype(np.float32))
        return PreferenceBatch(
            **{f.name: getattr(base, f.name) for f in fields(base)},
            loss_sequences=torch.from_numpy(owner[base.loss_positions.numpy()]),
            sequence_tokens=torch.tensor([float((labels[1:] != IGNORE_INDEX).sum()) for _, labels in examples]),
            examples=len(chunk), truncated_examples=int(dataset.truncated[chunk].sum()), reference_logps=reference,
            desirable=None if dataset.desirable is None else torch.from_numpy(dataset.desirable[chunk].copy()),
        )
