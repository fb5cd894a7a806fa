"""A PyTorch stand-in for the ``fast_hadamard_transform`` package's ``hadamard_transform``.

miles 78527b91's DeepSeek-V4 code rotates the indexer's queries and its compressed keys with
``fast_hadamard_transform.hadamard_transform`` (``miles_plugins/models/deepseek_v4/ops/utils.py``
``rotate_activation``; miles' ``docker/Dockerfile`` builds the CUDA package from Dao-AILab's sources). The
bundle's lock has no such package, so without it every layer with compress ratio 4 stops with
``AssertionError: fast_hadamard_transform is not installed.`` This module computes the same function with
torch operations: ``out = (x @ H_n) * scale`` with ``H_n`` the Sylvester-ordered Hadamard matrix
(``H_1 = [1]``, ``H_2k = [[H_k, H_k], [H_k, -H_k]]``), ``x`` zero-padded to the next power of two ``n`` and the
result cut back to ``x``'s width; the sums run in float32 and the result is rounded once to ``x``'s dtype (as
the package's CUDA kernel, which accumulates in float32). ``H_n`` is symmetric, so the gradient is the same
transform of the output gradient; torch's autograd derives it from the additions.
"""

from __future__ import annotations


def hadamard_transform(x, scale: float = 1.0):
    """``(x @ H_n) * scale`` over the last dimension of ``x`` (any leading shape, width ``d``; ``n`` the
    next power of two >= ``d``, ``x`` zero-padded to ``n``, the output cut back to ``d``), computed in float32
    with ``log2(n)`` butterfly stages and returned in ``x``'s dtype and shape. Raises ``ValueError`` for a
    zero-width ``x``."""
    import torch

    width = x.shape[-1]
    if width == 0:
        raise ValueError("hadamard_transform: the last dimension of x is empty")
    n = 1 << (width - 1).bit_length()
    y = x.float().reshape(-1, width)
    if n != width:
        y = torch.nn.functional.pad(y, (0, n - width))
    half = 1
    while half < n:
        pairs = y.reshape(y.shape[0], n // (2 * half), 2, half)
        first, second = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack((first + second, first - second), dim=2).reshape(y.shape[0], n)
        half *= 2
    return (y[:, :width] * scale).to(x.dtype).reshape(x.shape)
