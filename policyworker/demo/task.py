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
from transformers import LlamaConfig, PreTrainedTokenizerFast

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


def tiny_llama_config(vocab_size: int) -> LlamaConfig:
    """The built-in task's model: a 0.6M-parameter Llama."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(folder: str | Path, *, field: str = "--model") -> Any:
    """The checkpoint's own tokenizer, with a pad token; a `ValueError` naming `field` if the
    folder has none or it does not load (rather than transformers' guesses at a fallback)."""
    path = Path(folder)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{field}: {folder} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, ImportError, KeyError, TypeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{field}: the tokenizer in {folder} does not load ({reason})") from None
    if tok.eos_token_id is None:
        raise ValueError(f"{field}: the tokenizer in {folder} has no eos token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_jsonl(path: str | Path, *, field: str = "--data") -> list[Example]:
    """Prompt/answer pairs from a JSONL file; a malformed line is a ValueError naming it."""
    if not Path(path).is_file():
        raise ValueError(f"{field}: {path} is not a file (expected a JSONL of prompt/answer rows)")
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row: dict[str, Any] = json.loads(line)
            prompt, answer = row["prompt"], row["answer"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{field}: {path}:{i}: expected a JSON object with 'prompt' and 'answer' ({e})"
            ) from None
        if not isinstance(prompt, str) or not prompt or not isinstance(answer, str | int):
            raise ValueError(
                f"{field}: {path}:{i}: expected a non-empty string prompt and a string or "
                f"integer answer, got {prompt!r} and {answer!r}"
            )
        out.append(Example(prompt=prompt, answer=str(answer)))
    if not out:
        raise ValueError(f"{field}: {path} has no examples")
    return out


def reward(response: str, answer: str) -> float:
    """1 if the response (up to end of sequence, stripped) is exactly the answer, else 0."""
    return 1.0 if response.strip() == answer.strip() else 0.0
