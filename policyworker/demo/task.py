"""Tasks for the demo: a verifiable prompt -> answer set, a tokenizer, and a reward.

The built-in task is single-digit addition ("3+5=" -> "8") with a character tokenizer. A user's
task is a JSONL file of {"prompt": ..., "answer": ...} with the checkpoint's own tokenizer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CHARS = list("0123456789+=")


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A Hugging Face tokenizer with one token per character (saves and loads like any other)."""
    specials = ["<pad>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # "1", "2" -> "12", not "1 2"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


@dataclass(frozen=True, slots=True)
class Example:
    prompt: str
    answer: str


def addition_examples(rng: random.Random, n: int) -> list[Example]:
    """`n` random single-digit sums."""
    out = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        out.append(Example(prompt=f"{a}+{b}=", answer=str(a + b)))
    return out


def noisy_labels(
    rng: random.Random, examples: list[Example], wrong_fraction: float
) -> list[Example]:
    """Replace the answer of ~`wrong_fraction` of the examples with a wrong sum (SFT noise)."""
    out = []
    for ex in examples:
        if rng.random() < wrong_fraction:
            wrong = str((int(ex.answer) + rng.randrange(1, 19)) % 19)
            out.append(Example(ex.prompt, wrong))
        else:
            out.append(ex)
    return out


def load_jsonl(path: str | Path) -> list[Example]:
    """Prompt/answer pairs from a JSONL file; a malformed line is a ValueError naming it."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row: dict[str, Any] = json.loads(line)
            out.append(Example(prompt=str(row["prompt"]), answer=str(row["answer"])))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}:{i}: expected a JSON object with 'prompt' and 'answer' ({e})"
            ) from None
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


def reward(response: str, answer: str) -> float:
    """1 if the response (up to end of sequence, stripped) is exactly the answer, else 0."""
    return 1.0 if response.strip() == answer.strip() else 0.0
