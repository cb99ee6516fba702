"""One tensor of a Hugging Face checkpoint as part of an hpcpipe layer group (what each kind's name map lists).

hpcpipe stores every matrix (in, out) so that ``y = x @ weight``; transformers' ``nn.Linear`` weights are
(out, in) and are transposed on the way in and out (``transpose``), other tensors are taken as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD = "lm_head.weight"     # outside the base model: never carries the base-model prefix


@dataclass(frozen=True)
class Piece:
    """One tensor of a group: its HF name (without the base-model prefix), hpcpipe name and hpcpipe shape.

    ``stack``: the tensor is slice ``stack`` of the hpcpipe parameter (every expert of a block in one (E, ...)
    array, each expert its own tensor in the file); ``shape`` is then the slice's.
    """

    hf: str
    name: str
    shape: tuple[int, ...]
    transpose: bool = False
    stack: int | None = None

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape the tensor has in a Hugging Face file."""
        return self.shape[::-1] if self.transpose else self.shape


def param_shapes(pieces: list[Piece]) -> dict[str, tuple[int, ...]]:
    """The hpcpipe shape of each parameter the pieces make: a stacked one (E, *slice) with E its slices."""
    out: dict[str, tuple[int, ...]] = {}
    for piece in pieces:
        if piece.stack is None:
            out[piece.name] = piece.shape
        else:
            count = max(piece.stack + 1, out.get(piece.name, (0,))[0])
            out[piece.name] = (count, *piece.shape)
    return out
