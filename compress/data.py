"""Training data for steps: named data sets or local files, read with `datasets`, packed into rows.

A step's `data` is either the name of a data set in the `DataCatalog` the caller passes (the
recipe loader and the pipeline pass `catalog.data.NAMED`: `corpus`, `shift`, `shakespeare`, each
with splits written to local JSON-lines files) or the path of a local `.jsonl` / `.json` file with
a `text` field, or a `.txt` file (one document per line). Nothing is fetched, and nothing here is
registered globally.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

DataCatalog = Mapping[str, Callable[[], dict[str, Path]]]
"""name -> function returning {split: local file} (written on first use)."""
NO_DATA: DataCatalog = MappingProxyType({})

_FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text"}


def check_data(value: str, base_dir: Path, named: DataCatalog = NO_DATA) -> str:
    """A data set of `named` or an existing, non-empty local file (relative to `base_dir`);
    returns the value to store (names as given, paths absolute). Raises ValueError naming the
    fix."""
    if value in named:
        return value
    path = (base_dir / value).expanduser().resolve()
    if path.suffix not in _FORMATS:
        names = ", ".join(named) or "none given"
        raise ValueError(
            f"found {value!r}: neither a named data set ({names}) nor a .jsonl/.json/.txt file"
        )
    if not path.is_file():
        raise ValueError(f"found {value!r}: no such file ({path}); give an existing data file")
    if not path.read_text(errors="replace").strip():
        raise ValueError(f"found {value!r}: the file {path} is empty; give it some text")
    return str(path)


def check_data_in_context(value: str, context: dict[str, Any] | None) -> str:
    """`check_data` for a params validator: the recipe dir and the catalog come from pydantic's
    validation context (`recipe_dir`, `data`), as the recipe loader passes them."""
    context = context or {}
    return check_data(value, context.get("recipe_dir", Path.cwd()), context.get("data", NO_DATA))


def data_files(value: str, named: DataCatalog = NO_DATA) -> dict[str, Path]:
    """{split: file} for a checked `data` value; a single local file is the train split."""
    return named[value]() if value in named else {"train": Path(value)}


def load_texts(value: str, split: str = "train", named: DataCatalog = NO_DATA) -> list[str]:
    """The split's documents, read with `datasets` from local files."""
    from datasets import load_dataset

    files = data_files(value, named)
    if split not in files:
        raise ValueError(f"data {value!r} has no {split!r} split (it has {', '.join(files)})")
    path = files[split]
    dataset = load_dataset(_FORMATS[path.suffix], data_files={split: str(path)}, split=split)
    if "text" not in dataset.column_names:
        raise ValueError(f"{path}: records need a 'text' field (found {dataset.column_names})")
    texts = [t for t in dataset["text"] if t and t.strip()]
    if not texts:
        raise ValueError(f"{path}: no non-empty 'text' records")
    return texts


def token_rows(tok: PreTrainedTokenizerBase, texts: list[str], seq_len: int) -> torch.Tensor:
    """Documents (each with the tokenizer's own bos) joined by eos, cut into full rows."""
    stream: list[int] = []
    for ids in tok(texts)["input_ids"]:
        stream.extend(ids)
        stream.append(tok.eos_token_id)
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"the data holds {len(stream)} tokens, fewer than one row of {seq_len}")
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


@torch.no_grad()
def perplexity(model: torch.nn.Module, rows: torch.Tensor, batch_size: int = 16) -> float:
    """exp(mean next-token NLL) over every row; each row is scored on its own."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size].to(device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += nll.item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)
