"""h5py imported on first use: ``from hpcpipe.lazy_h5py import h5py`` instead of ``import h5py``.

h5py and its HDF5 library take ~13 MiB of a rank's memory, and a rank that generates or serves from a
Hugging Face directory never opens an HDF5 file; the modules it imports for the hpcpipe formats still name
h5py at their top. The standard library's LazyLoader runs h5py's own import at the first attribute use.
"""

from __future__ import annotations

import importlib.util
import sys


def _lazy(name: str):
    """The module ``name``, loaded when first used (or as it is, when something imported it already)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ImportError(f"hpcpipe needs {name} (pip install {name})")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


h5py = _lazy("h5py")
