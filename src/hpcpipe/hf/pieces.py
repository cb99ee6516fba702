"""One tensor of a Hugging Face checkpoint as part of an hpcpipe layer group (what each kind's name map lists).

hpcpipe stores every matrix (in, out) so that ``y = x @ weight``; transformers' ``nn.Linear`` weights are
(out, in) and are transposed on the way in and out (``transpose``), other tensors are taken as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD = "lm_head.weight"     # outside the base model: never carries the base-model prefix


@dataclass(frozen=True)
class Piece:
    """One tensor of a group: its HF name (without the base-model prefix), hpcpipe name and hpcpipe shape."""

    hf: str
    name: str
    shape: tuple[int, ...]
    transpose: bool = False

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape the tensor has in a Hugging Face file."""
        return self.shape[::-1] if self.transpose else self.shape
