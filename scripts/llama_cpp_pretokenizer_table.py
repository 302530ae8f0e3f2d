"""Regenerate ftctl/export/llama_cpp_pretokenizers.json from a llama.cpp source tree.

llama.cpp's converter names a byte-level BPE tokenizer's pre-tokenizer (``tokenizer.ggml.pre``) by
encoding one fixed check text and looking the SHA-256 of the token ids up in a table of known
tokenizers (``get_vocab_base_pre``). ftctl identifies tokenizers the same way and keeps that text and
table as data; this script reads them out of llama.cpp's Python source (it executes nothing from it):

    python scripts/llama_cpp_pretokenizer_table.py path/to/llama.cpp [--source "llama.cpp bNNNN"]

The table follows llama.cpp's rule that a later entry for the same hash wins.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "ftctl" / "export" / "llama_cpp_pretokenizers.json"
FUNCTION = "get_vocab_base_pre"
ENTRY = re.compile(r'chkhsh == "(?P<hash>[0-9a-f]{64})":\s*\n(?:\s*#\s*ref:\s*(?P<ref>\S+)\s*\n)?\s*res = "(?P<name>[^"]+)"')


def converter_source(tree: Path) -> str:
    """The file of ``tree`` that defines get_vocab_base_pre (conversion/base.py today, convert_hf_to_gguf.py before)."""
    for candidate in (tree / "conversion" / "base.py", tree / "convert_hf_to_gguf.py", tree):
        if candidate.is_file() and f"def {FUNCTION}" in candidate.read_text(encoding="utf-8"):
            return candidate.read_text(encoding="utf-8")
    raise SystemExit(f"{tree}: no file defining {FUNCTION} (give a llama.cpp checkout or the file itself)")


def read_table(source: str) -> dict:
    function = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef) and node.name == FUNCTION)
    check_text = next(
        node.value.value for node in ast.walk(function)
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "chktxt"
    )
    body = ast.get_source_segment(source, function)
    names, refs = {}, {}
    for match in ENTRY.finditer(body):
        names[match["hash"]] = match["name"]
        refs[match["hash"]] = match["ref"]
    if not names:
        raise SystemExit(f"found no hash entries in {FUNCTION}")
    return {"check_text": check_text, "names": names, "refs": refs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llama_cpp", type=Path, help="a llama.cpp checkout (or its converter file)")
    parser.add_argument("--source", default="llama.cpp", help="what to record as the table's origin, e.g. a release tag")
    args = parser.parse_args()
    table = read_table(converter_source(args.llama_cpp))
    OUT.write_text(json.dumps({"source": args.source, **table}, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"{len(table['names'])} tokenizers ({len(set(table['names'].values()))} pre-tokenizer names) -> {OUT}")


if __name__ == "__main__":
    main()
