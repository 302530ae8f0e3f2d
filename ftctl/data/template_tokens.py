"""A named chat template's special tokens on a tokenizer that lacks them (``data.add_special_tokens``).

``llama3`` on a tokenizer without ``<|eot_id|>`` spells every marker in pieces: each turn spends
tokens on them and the model must learn to spell its end of turn. Without
``data.add_special_tokens`` that is one warning; with it, the markers become special tokens of the
tokenizer (saved with the result), and the method grows the model's embeddings and output head for
them and trains their rows (:meth:`ftctl.methods.base.Method.grow_vocabulary`), as axolotl's
``special_tokens``/``tokens`` settings do.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

from ftctl.data.chat_templates import TEMPLATE_SPECIAL_TOKENS

log = logging.getLogger("ftctl")


def split_special_tokens(tokenizer, template: Optional[str]) -> Dict[str, int]:
    """The special tokens of the named ``template`` that ``tokenizer`` splits, each with its number of pieces."""
    pieces = {token: len(tokenizer.encode(token, add_special_tokens=False)) for token in TEMPLATE_SPECIAL_TOKENS.get(template or "", ())}
    return {token: n for token, n in pieces.items() if n != 1}


def add_template_tokens(tokenizer, template: Optional[str], add: bool, *, say: bool = True) -> List[int]:
    """With ``add`` (data.add_special_tokens), add the named template's special tokens the tokenizer splits and
    return their ids, for the model to grow and train; without it, warn in one line (``say``: this process
    speaks for the run) and return []."""
    split = split_special_tokens(tokenizer, template)
    if not split:
        return []
    if not add:
        if say:
            listed = ", ".join(f"{token} ({n} tokens)" for token, n in split.items())
            log.warning("data.chat_template=%s: this tokenizer splits its special tokens %s, so every turn spends tokens "
                        "on them and the model must learn to spell its end of turn; data.add_special_tokens=true adds "
                        "them as tokens and trains their new embedding and output rows", template, listed)
        return []
    tokenizer.add_tokens(list(split), special_tokens=True)
    ids = [tokenizer.convert_tokens_to_ids(token) for token in split]
    if say:
        log.info("data.add_special_tokens: added %s as tokens %s; their embedding and output rows train",
                 ", ".join(split), ", ".join(map(str, ids)))
    return ids
