"""Teachers' LM heads on the student, for full-vocabulary distillation from hidden states.

A teacher sends its final hidden states (`get_logprobs_with_full_payload(payload=
"hidden_states")`, 1/74 of the logits for a 150k vocabulary); the student turns them into the
teacher's logits with the teacher's LM head. Each student TP rank keeps only the rows of its own
vocabulary columns ([cols, H_teacher], the student's split), and only the last pipeline stage
(where the loss runs) holds them; the others record the path. The shards are plain tensors:
not parameters, not in checkpoints, not in refits.

Lifecycle (`opd_full_teacher_lm_head_lifecycle`), following the memory phases: `stage()` puts
every shard on the device for a train step; `release()`, on entering any phase but training,
leaves them there ("none"), moves them to the host ("offload") or drops them, to be read from the
teacher's checkpoint again at the next step ("evict").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from policyworker.data.contract import FULL_PAYLOAD, check_full_payload
from policyworker.data.microbatch import Microbatch
from policyworker.model.hf_config import load_hf_config, model_shape
from policyworker.model.weights import SafetensorsReader
from policyworker.ops.kl import TeacherRows

Lifecycle = Literal["none", "offload", "evict"]
LIFECYCLES = ("none", "offload", "evict")
TEACHER_INDEX = "teacher_index"


@dataclass(slots=True)
class _Teacher:
    path: Path
    tied: bool
    """The LM head is the embedding (`model.embed_tokens.weight`)."""
    hidden_size: int
    weight: torch.Tensor | None
    """[cols, H] this rank's rows; None off the last stage, or evicted."""
    place: str = "device"
    """"device", "host" or "evicted" (what `release` did last; on a CPU-only run the host and
    the device are one memory)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VocabSlice:
    """This rank's columns of the student's vocabulary: ids [start, start + cols)."""

    start: int
    cols: int
    vocab_size: int
    """The student's true vocabulary; a teacher's must be at least as large."""


class TeacherHeads:
    """The teacher LM-head shards of this rank, by `teacher_index`; see the module docstring."""

    def __init__(
        self,
        *,
        lifecycle: Lifecycle,
        device: torch.device,
        dtype: torch.dtype,
        vocab: VocabSlice,
        last_stage: bool,
    ) -> None:
        self.lifecycle, self.device, self.dtype = lifecycle, device, dtype
        self.vocab, self.last_stage = vocab, last_stage
        self._teachers: dict[int, _Teacher] = {}

    @property
    def indices(self) -> list[int]:
        return sorted(self._teachers)

    @property
    def hidden_size(self) -> int | None:
        return next((t.hidden_size for t in self._teachers.values()), None)

    def load(self, path: str, index: int) -> None:
        """Read this rank's shard of the teacher at `path` (an HF folder) as `index`, on the
        device; a teacher loaded under `index` before is replaced. Raises `ValueError` (and
        changes nothing) for a folder that is not a model this worker runs, a vocabulary smaller
        than the student's, or a hidden size unlike the other teachers'."""
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"teacher_index: expected an int >= 0, got {index!r}")
        field = "teacher_path_config.model_name"
        shape = model_shape(load_hf_config(path, field=field))
        if shape.vocab_size < self.vocab.vocab_size:
            raise ValueError(
                f"{field}: the teacher's vocabulary ({shape.vocab_size}) is smaller than the "
                f"student's ({self.vocab.vocab_size}); full-vocabulary distillation needs the "
                "same tokenizer"
            )
        others = {t.hidden_size for i, t in self._teachers.items() if i != index}
        if others and shape.hidden_size not in others:
            raise ValueError(
                f"{field}: hidden size {shape.hidden_size} disagrees with the teachers already "
                f"loaded ({sorted(others)[0]})"
            )
        teacher = _Teacher(Path(path), shape.tie_word_embeddings, shape.hidden_size, None)
        if self.last_stage:
            teacher.weight = self._read(teacher)
        self._teachers[index] = teacher

    def stage(self) -> None:
        """Every shard on the device (read again if evicted): before a train step."""
        for t in self._teachers.values():
            if self.last_stage:
                t.weight = self._read(t) if t.weight is None else t.weight.to(self.device)
            t.place = "device"

    def release(self) -> None:
        """Apply the lifecycle after training: keep, offload to the host, or drop the shards."""
        if self.lifecycle == "none":
            return
        offload = self.lifecycle == "offload"
        for t in self._teachers.values():
            if t.weight is not None:
                t.weight = t.weight.to("cpu") if offload else None
            t.place = "host" if offload else "evicted"

    def where(self) -> dict[int, str]:
        """Each teacher's shard: "device", "host" or "evicted" (off the last stage, where no
        shard is held, what it would be)."""
        return {i: t.place for i, t in self._teachers.items()}

    def rows(self, mb: Microbatch, payload: str, device: torch.device) -> TeacherRows:
        """The teacher side of a micro-batch's KL, in the model's layout (this CP rank's
        tokens): its payload rows, moved to the device here (the batch may keep them on the
        host), and for a hidden-state payload the heads and each token's teacher."""
        x = mb.data[FULL_PAYLOAD].to(device, non_blocking=True)
        x = mb.to_local(mb.pack(x))
        x = x.reshape(-1, x.shape[-1])
        if payload == "logits":
            return TeacherRows(x)
        heads = tuple(w for w in (self._teachers[i].weight for i in self.indices) if w is not None)
        assert heads and len(heads) == len(self._teachers), "stage() runs before a step"
        if len(heads) == 1:
            return TeacherRows(x, heads)
        position = {index: k for k, index in enumerate(self.indices)}
        which = torch.tensor([position[int(i)] for i in mb.data[TEACHER_INDEX].tolist()])
        per_token = which.to(device)[:, None].expand(-1, mb.data["input_ids"].shape[1])
        return TeacherRows(x, heads, mb.to_local(mb.pack(per_token)).reshape(-1))

    def check_batch(self, data: dict, payload: str) -> None:
        """The batch's payload [B, S, D] (finite floats; D the teachers' hidden size, or at least
        the vocabulary for logits) and `teacher_index` when several heads are loaded.
        Raises `BatchValidationError`."""
        if payload == "hidden_states":
            if not self._teachers:
                raise ValueError(
                    "loss_fn: a hidden-state payload needs the teacher's LM head: call "
                    "load_opd_full_teacher_lm_head() first"
                )
            width = self.hidden_size
            indices = self.indices if len(self._teachers) > 1 else None
        else:
            width, indices = None, None
        check_full_payload(data, hidden=width, vocab=self.vocab.vocab_size, indices=indices)

    def _read(self, t: _Teacher) -> torch.Tensor:
        name = "model.embed_tokens.weight" if t.tied else "lm_head.weight"
        v = self.vocab
        rows = SafetensorsReader(t.path).rows(name, v.start, v.start + v.cols)
        return rows.to(self.device, self.dtype)
