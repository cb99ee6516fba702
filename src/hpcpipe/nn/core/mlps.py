"""The decoders' MLPs over (micro-batch, T, d) blocks, each with a split backward.

``GeluMLP`` (GPT-2): ``gelu_tanh(u @ Wfc + bfc) @ Wproj + bproj``. ``SwiGLU`` (Llama):
``(silu(u @ Wgate) * (u @ Wup)) @ Wdown``. With tensor parallelism (``tp``: the stage's group) the first
projections are column-parallel (their input gradients summed over the ranks, once) and the last one
row-parallel (its partial output summed before the bias).
"""

from __future__ import annotations

from typing import Any

from hpcpipe.nn.core.activations import GELU
from hpcpipe.nn.core.dense import linear, rows
from hpcpipe.nn.core.tensor_parallel import is_split


class GeluMLP:
    """``gelu_tanh(u @ Wfc + bfc) @ Wmp + bmp`` (``mlp/fc``, ``mlp/proj``) over (micro-batch, T, d) blocks."""

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], xp: Any, prefix: str = "mlp", tp: Any = None):
        fc = f"{prefix}/fc"
        split = tp if is_split(tp) else None     # fc column-parallel, proj row-parallel
        self.fc = linear(params, grads, fc, xp, reduce_input_grad=split, activation=GELU())
        self.proj = linear(params, grads, f"{prefix}/proj", xp, reduce_out=split)

    def forward(self, u: Any) -> tuple[Any, tuple]:
        """Return (MLP output, cache)."""
        hidden, fc_cache = self.fc.forward(rows(u))
        y, proj_cache = self.proj.forward(hidden)
        return y.reshape(u.shape), (fc_cache, proj_cache)

    def forward_cache(self, u: Any) -> tuple:
        """Return only the cache of forward(u): the projection's output is not computed."""
        hidden, fc_cache = self.fc.forward(rows(u))
        return fc_cache, self.proj.forward_cache(hidden)

    def backward_input(self, cache: tuple, g: Any, need_input_grad: bool = True) -> tuple[Any, tuple[Any, Any]]:
        """Return (dL/du, (dL/d fc pre-activation, dL/dy)) for backward_weight."""
        g_hidden, dz_proj = self.proj.backward_input(cache[1], rows(g))
        gu, dz_fc = self.fc.backward_input(cache[0], g_hidden)
        return gu.reshape(g.shape), (dz_fc, dz_proj)

    def backward_weight(self, cache: tuple, state: tuple[Any, Any]) -> None:
        """Accumulate the gradients of mlp/fc and mlp/proj."""
        self.fc.backward_weight(cache[0], state[0])
        self.proj.backward_weight(cache[1], state[1])

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/du."""
        gu, state = self.backward_input(cache, g)
        self.backward_weight(cache, state)
        return gu


class SwiGLU:
    """``(silu(u @ Wgate) * (u @ Wup)) @ Wdown`` (``mlp/{gate,up,down}``) over (micro-batch, T, d) blocks.

    Backward, with s = sigmoid(gate), act = gate s and dh = dL/dhidden:
    d_up = dh act, d_gate = dh up (s + act (1 - s)).
    """

    def __init__(self, params: dict[str, Any], grads: dict[str, Any], xp: Any, prefix: str = "mlp", tp: Any = None):
        self.tp = tp if is_split(tp) else None      # gate and up column-parallel, down row-parallel
        self.gate = linear(params, grads, f"{prefix}/gate", xp, bias=False)
        self.up = linear(params, grads, f"{prefix}/up", xp, bias=False)
        self.down = linear(params, grads, f"{prefix}/down", xp, bias=False, reduce_out=self.tp)
        self.xp = xp

    def _hidden(self, u: Any) -> tuple[Any, tuple]:
        xp = self.xp
        x = rows(u)
        gate, c_gate = self.gate.forward(x)
        up, c_up = self.up.forward(x)
        # sigmoid(z) = (1 + tanh(z / 2)) / 2: no overflow warning for large |z|, unlike 1 / (1 + exp(-z))
        s = gate * 0.5
        xp.tanh(s, out=s)
        s += 1
        s *= 0.5
        gate *= s                                       # silu(gate), in the projection's own buffer
        return gate * up, (c_gate, c_up, s, gate, up)

    def forward(self, u: Any) -> tuple[Any, tuple]:
        """Return (MLP output, cache)."""
        hidden, cache = self._hidden(u)
        y, c_down = self.down.forward(hidden)
        return y.reshape(u.shape), (*cache, c_down)

    def forward_cache(self, u: Any) -> tuple:
        """Return only the cache of forward(u): the down projection is not computed."""
        hidden, cache = self._hidden(u)
        return (*cache, self.down.forward_cache(hidden))

    def backward_input(self, cache: tuple, g: Any, need_input_grad: bool = True) -> tuple[Any, tuple]:
        """Return (dL/du, (dL/dgate, dL/dup, dL/dy)) for backward_weight."""
        xp = self.xp
        c_gate, c_up, s, act, up, c_down = cache
        gh, dz_down = self.down.backward_input(c_down, rows(g))
        d_up = gh * act
        gh *= up
        slope = xp.subtract(1, s)                       # silu'(gate) = s + act (1 - s)
        slope *= act
        slope += s
        gh *= slope
        gu, dz_gate = self.gate.backward_input(c_gate, gh, need_input_grad)
        gu_up, dz_up = self.up.backward_input(c_up, d_up, need_input_grad)
        if need_input_grad:
            gu += gu_up
            if self.tp is not None:     # one sum of gate's and up's partial input gradients
                self.tp.sum_(gu)
            gu = gu.reshape(g.shape)
        return gu, (dz_gate, dz_up, dz_down)

    def backward_weight(self, cache: tuple, state: tuple) -> None:
        """Accumulate the gradients of mlp/gate, mlp/up and mlp/down."""
        self.gate.backward_weight(cache[0], state[0])
        self.up.backward_weight(cache[1], state[1])
        self.down.backward_weight(cache[5], state[2])

    def backward(self, cache: tuple, g: Any, need_input_grad: bool = True) -> Any:
        """Accumulate the weight gradients and return dL/du."""
        gu, state = self.backward_input(cache, g, need_input_grad)
        self.backward_weight(cache, state)
        return gu
