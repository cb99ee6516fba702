"""The mlp kind (``model.kind = "mlp"``, the default): Linear layers with an activation."""

from hpcpipe.nn.kind import Kind
from hpcpipe.nn.mlp.keys import KEYS, validate, validate_tp
from hpcpipe.nn.mlp.model import MLPModel

KIND = Kind(name="mlp", title="an MLP", keys=KEYS, model=MLPModel, validate=validate, validate_tp=validate_tp)
