"""The moe kind (``model.kind = "moe"``): llama-family decoders with sparse mixtures of experts (Mixtral, Qwen3-MoE)."""

from hpcpipe.nn.kind import Kind
from hpcpipe.nn.moe.hf import HF
from hpcpipe.nn.moe.keys import KEYS, validate, validate_ep, validate_tp
from hpcpipe.nn.moe.model import MoEModel

KIND = Kind(name="moe", title="a mixture-of-experts model", keys=KEYS, model=MoEModel.from_config, validate=validate,
            validate_tp=validate_tp, validate_ep=validate_ep, decoder=True, seq_len_free=True, hf=HF)
