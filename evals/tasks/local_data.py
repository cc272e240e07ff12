"""Documents for the bundled lm-eval tasks, read from local files only (nothing from a hub).

lm-eval calls these through `custom_dataset: !function local_data.<name>` and gets
`{"test": datasets.Dataset}`. The texts are the demo corpora's held-out splits (the stdlib
docstring corpus and the shop log, see docs/demo-model.md), so every machine has them.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

from datasets import Dataset

from catalog.data import NAMED
from catalog.shifted import colour_questions
from compress.data import load_texts

CLOZE_ITEMS = 200
CLOZE_CHOICES = 4
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _split(rows: list[dict[str, Any]]) -> dict[str, Dataset]:
    return {"test": Dataset.from_list(rows)}


def corpus_documents(**_: Any) -> dict[str, Dataset]:
    """The base corpus's validation documents, whole (for `loglikelihood_rolling`)."""
    return _split([{"text": t} for t in load_texts("corpus", "validation", NAMED)])


def shift_documents(**_: Any) -> dict[str, Dataset]:
    """The shifted domain's (shop log) validation documents, whole."""
    return _split([{"text": t} for t in load_texts("shift", "validation", NAMED)])


def shakespeare_documents(**_: Any) -> dict[str, Dataset]:
    """Held-out plays' documents (the shakespeare data set's test split: plays no step trains
    or validates on)."""
    return _split([{"text": t} for t in load_texts("shakespeare", "test", NAMED)])


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def held_out_sentences() -> list[str]:
    """Prose sentences of 8-30 words from the base corpus's test split, in a fixed order that
    does not depend on the documents' order (sorted by a hash of the sentence)."""
    found = set()
    for doc in load_texts("corpus", "test", NAMED):
        for raw in _SENTENCE_END.split(doc):
            sentence = " ".join(raw.split())
            words = sentence.split(" ")
            letters = sum(ch.isalpha() or ch == " " for ch in sentence)
            if 8 <= len(words) <= 30 and letters >= 0.9 * len(sentence):
                found.add(sentence)
    return sorted(found, key=_key)


def corpus_cloze(**_: Any) -> dict[str, Dataset]:
    """Multiple choice: a held-out sentence's first half, its true second half among the second
    halves of `CLOZE_CHOICES - 1` other held-out sentences (the next ones in hash order)."""
    sentences = held_out_sentences()
    halves = []
    for s in sentences:
        words = s.split(" ")
        cut = math.ceil(len(words) / 2)
        halves.append((" ".join(words[:cut]), " ".join(words[cut:])))
    rows = []
    for i, (context, ending) in enumerate(halves[:CLOZE_ITEMS]):
        others = [halves[(i + k) % len(halves)][1] for k in range(1, len(halves))]
        distractors = list(dict.fromkeys(e for e in others if e != ending))[: CLOZE_CHOICES - 1]
        label = int(_key(context), 16) % CLOZE_CHOICES
        choices = [*distractors[:label], ending, *distractors[label:]]
        rows.append({"context": context, "choices": choices, "label": label})
    return _split(rows)


def shop_colours(**_: Any) -> dict[str, Dataset]:
    """Multiple choice: each shop item's colour among all eight colours (the shifted domain's
    facts; the base model cannot know them, an adapter trained on the shop log can)."""
    return _split(colour_questions())


def boolq_label_from_answer(dataset: Dataset) -> Dataset:
    """The bundled BoolQ (google/boolq) has a boolean `answer`; lm-eval's task reads super_glue's
    integer `label` (0: no, 1: yes)."""
    return dataset.map(lambda doc: {"label": int(doc["answer"])})
