"""Compute kernels behind one interface: compiled CPU kernels, with NumPy as the reference they are tested against.

``formats``: weights kept as stored (float32, bfloat16/float16 bits, q8_0 blocks) as (out, in) rows;
``cpu``: the compiled products, norms and a whole decode stage in one call (ctypes over ``csrc/``);
``stage``: a decode stage's blocks laid out for that call; ``cuda``: the same products on a GPU over CuPy arrays
(NVRTC-compiled RawKernels; checked by tests/gpu on a GPU lease); ``row_product``: a stored weight standing in for
a layer's float matrix, multiplied by the backend's products (a GPU stage's stored and q8_0 weights).
Without a C compiler at install time (or with
``HPCPIPE_KERNELS=numpy``) nothing is compiled and hpcpipe computes with NumPy alone.
"""
