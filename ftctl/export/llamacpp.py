"""llama.cpp itself, through its Python binding (llama-cpp-python), for what only llama.cpp can say or do.

* :func:`quantize`: k-quants (q4_k_m, q5_k_m, q6_k) written by llama.cpp's own quantizer
  (``llama_model_quantize``) from an f16 file ftctl wrote, as ``llama-quantize`` would.
* :func:`tokenization_differences`: the check texts llama.cpp tokenizes differently from transformers,
  loading only the vocabulary of a written file: it confirms the pre-tokenizer ftctl named.

The binding is optional (``pip install 'ftctl[llamacpp]'``; it compiles llama.cpp, a few minutes);
callers ask :func:`available` first. llama.cpp's own log lines are kept to its errors.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
from pathlib import Path
from typing import Iterable, List

from ftctl.errors import FtctlError

INSTALL_HINT = "pip install 'ftctl[llamacpp]' (llama-cpp-python; it compiles llama.cpp, a few minutes on 2 cores)"

#: gguf.quant= -> the llama_ftype that llama.cpp's quantizer writes (its LLAMA_FTYPE_MOSTLY_* names).
K_QUANTS = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


#: ggml's log level of errors (ggml.h: NONE, DEBUG, INFO, WARN, ERROR, CONT). The binding's own callback still
#: maps the older numbering, under which errors pass for debug lines and warnings for errors.
GGML_LOG_LEVEL_ERROR = 4


@contextlib.contextmanager
def _llama_cpp(errors: List[str]):
    """The binding with its backend started, llama.cpp's log going to ``errors`` (its error lines) and nowhere else;
    the binding's own log callback is back afterwards."""
    if not available():
        raise FtctlError(f"this needs llama.cpp's Python binding: {INSTALL_HINT}")
    import llama_cpp

    @llama_cpp.llama_log_callback
    def keep_errors(level, text, user_data):
        if level == GGML_LOG_LEVEL_ERROR:
            errors.append(text.decode("utf-8", errors="replace").strip())

    llama_cpp.llama_log_set(keep_errors, ctypes.c_void_p(0))
    try:
        llama_cpp.llama_backend_init()
        yield llama_cpp
    finally:
        binding_logger = getattr(importlib.import_module("llama_cpp._logger"), "llama_log_callback", None)
        llama_cpp.llama_log_set(binding_logger, ctypes.c_void_p(0))


def _first_error(errors: List[str]) -> str:
    """llama.cpp's reason: its 'error loading model...' line when there is one."""
    return next((line for line in errors if "error" in line.lower()), errors[0] if errors else "llama.cpp gave no reason")


def quantize(source: Path, output: Path, quant: str, threads: int = 0) -> None:
    """Write ``output``, ``source`` (an f16/f32 GGUF file) quantized by llama.cpp to ``quant`` (a key of K_QUANTS)."""
    errors: List[str] = []
    with _llama_cpp(errors) as llama_cpp:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, K_QUANTS[quant])
        params.nthread = threads or os.cpu_count() or 1
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(output).encode(), ctypes.byref(params))
    if status != 0:
        raise FtctlError(f"llama.cpp could not quantize to {quant}: {_first_error(errors)}")


def tokenize_with_vocab(path: Path, texts: Iterable[str]) -> List[List[int]]:
    """What llama.cpp's tokenizer makes of each text (special tokens parsed, BOS/EOS as the file says), loading only the vocabulary."""
    errors: List[str] = []
    with _llama_cpp(errors) as llama_cpp:
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise FtctlError(f"llama.cpp cannot load the written file's vocabulary: {_first_error(errors)}")
        try:
            vocab = llama_cpp.llama_model_get_vocab(model)
            return [_tokenize(llama_cpp, vocab, text) for text in texts]
        finally:
            llama_cpp.llama_model_free(model)


def _tokenize(llama_cpp, vocab, text: str) -> List[int]:
    data = text.encode("utf-8")
    capacity = len(data) + 8
    while True:
        buffer = (llama_cpp.llama_token * capacity)()
        count = llama_cpp.llama_tokenize(vocab, data, len(data), buffer, capacity, True, True)
        if count >= 0:
            return list(buffer[:count])
        capacity = -count  # the buffer was too small: llama.cpp says how many it needs


def tokenization_differences(path: Path, tokenizer, texts: List[str]) -> List[str]:
    """The texts for which llama.cpp's tokenizer (from the file at ``path``) gives other ids than ``tokenizer``."""
    llama_ids = tokenize_with_vocab(path, texts)
    return [text for text, ids in zip(texts, llama_ids) if ids != tokenizer.encode(text)]
