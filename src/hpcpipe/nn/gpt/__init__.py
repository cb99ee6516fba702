"""The gpt kind (``model.kind = "gpt"``): a GPT-2 style decoder; Hugging Face ``gpt2`` directories in and out."""

from hpcpipe.nn.gpt.hf import HF
from hpcpipe.nn.gpt.keys import KEYS, validate, validate_tp
from hpcpipe.nn.gpt.model import GPTModel
from hpcpipe.nn.kind import Kind

KIND = Kind(name="gpt", title="a GPT", keys=KEYS, model=GPTModel.from_config, validate=validate,
            validate_tp=validate_tp, decoder=True, hf=HF)
