"""The llama kind (``model.kind = "llama"``): Llama 2/3.x, Mistral, Qwen2, SmolLM, TinyLlama decoders."""

from hpcpipe.nn.kind import Kind
from hpcpipe.nn.llama.hf import HF
from hpcpipe.nn.llama.keys import KEYS, validate, validate_tp
from hpcpipe.nn.llama.model import LlamaModel

KIND = Kind(name="llama", title="a Llama-family model", keys=KEYS, model=LlamaModel.from_config, validate=validate,
            validate_tp=validate_tp, decoder=True, seq_len_free=True, hf=HF)
