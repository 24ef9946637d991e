"""Page key boxes in each head's principal axes (``principal_bounds=True``).

A page's score comes from the element-wise min/max box of its keys. ``q . k`` is the same in any orthonormal basis
(``q . k = (q R) . (k R)``), but the box is not: in the model's coordinates the keys of a page spread over most
dimensions, and a box aligned with them is loose; in the principal axes of the head's keys most of the spread sits
in a few axes and the box is tight in all others, so box scores rank pages closer to their true attention. The
basis of every (request, KV head) is taken once, from the real keys of the request's first chunk (the prompt; a cache
whose first chunk is a single token keeps the model's axes), and kept: boxes of later tokens are folded in the same
axes, and a query is turned into them before scoring. Attention itself reads the stored keys and the query as they
are. The axes are eigenvectors of each row's key covariance (:func:`symmetric_eigenvectors`: ``eigh`` on the CPU, a
batched approximate SVD on CUDA).

Shapes: ``B`` requests, ``H`` KV heads, ``D`` head dim; ``R`` (``[B, H, D, D]``, float32, float64 for float64 keys)
holds each row's axes as columns.
"""

from __future__ import annotations

import warnings

import torch

ORTHONORMAL_TOLERANCE = 1e-6  # max |R^T R - I| of a fast CUDA basis; a matrix above it is solved by eigh instead


def symmetric_eigenvectors(matrices: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of eigenvectors (columns, in no set order) of positive semi-definite ``matrices [N, D, D]``.

    On the CPU (and on ROCm), ``torch.linalg.eigh``. On CUDA, cuSOLVER's batched approximate SVD (``gesvda``; the
    SVD of such a matrix is its eigendecomposition), made orthonormal by four Newton-Schulz steps in float64 (exact
    whatever the TF32 setting): 64 matrices of ``128 x 128`` in ~2 ms, where ``eigh`` solves them one after another
    in 35-110 ms on an H200 (``eval/gpu_eigh_overlap.py``, ``eval/gpu_prefill_breakdown.py --eigh``). Its axes of
    large variance agree with ``eigh``'s, those of tiny variance (which barely widen a box) may mix. A matrix whose
    basis stays above :data:`ORTHONORMAL_TOLERANCE` (a rank-deficient one) is solved by ``eigh`` in float64, and if
    ``gesvda`` does not converge the whole batch is. Syncs with the host (torch's checks of ``gesvda`` and the
    fallback's): it runs once per layer, at its first chunk, never inside a CUDA graph.
    """
    if matrices.device.type != "cuda" or torch.version.hip is not None:
        return torch.linalg.eigh(matrices).eigenvectors
    try:
        with warnings.catch_warnings():  # torch's advice to try another driver: the fallback below is that
            warnings.simplefilter("ignore")
            vectors = torch.linalg.svd(matrices, full_matrices=False, driver="gesvda").U.double()
    except RuntimeError:  # did not converge
        return torch.linalg.eigh(matrices.double()).eigenvectors.to(matrices.dtype)
    identity = torch.eye(matrices.shape[-1], dtype=torch.float64, device=matrices.device)
    for _ in range(4):  # X <- X (3 I - X^T X) / 2: to the nearest orthonormal matrix, quadratically
        vectors = torch.bmm(vectors, 1.5 * identity - 0.5 * torch.bmm(vectors.mT, vectors))
    error = (torch.bmm(vectors.mT, vectors) - identity).abs().amax(dim=(1, 2))
    vectors = vectors.to(matrices.dtype)
    failed = (~(error <= ORTHONORMAL_TOLERANCE)).nonzero().flatten()  # NaN fails too
    if failed.numel():  # in float64: a float32 eigh of a rank-deficient matrix is orthonormal to ~1e-4 only
        vectors[failed] = torch.linalg.eigh(matrices[failed].double()).eigenvectors.to(matrices.dtype)
    return vectors


class KeyBasis:
    """Orthonormal axes ``matrix [B, H, D, D]`` (float32, or float64 for float64 keys) of one layer's (request, KV
    head) rows; vectors turned into them come out in its dtype, except a chunk of half-precision keys, which stays in
    theirs (:meth:`chunk`)."""

    def __init__(self, matrix: torch.Tensor) -> None:
        self.matrix = matrix

    @classmethod
    def principal_axes(cls, keys: torch.Tensor, valid: torch.Tensor | None) -> KeyBasis:
        """The principal axes of every row's real keys (a row without real keys keeps the model's axes).

        Args:
            keys: ``[B, H, T, D]`` a first chunk's keys; valid: ``[B, T]`` bool, the real tokens (``None``: all).
        """
        batch_size, num_heads, length, head_dim = keys.shape
        dtype = torch.promote_types(keys.dtype, torch.float32)
        covariance = torch.empty(batch_size, num_heads, head_dim, head_dim, dtype=dtype, device=keys.device)
        weights = (torch.ones(batch_size, length, dtype=dtype, device=keys.device) if valid is None
                   else valid.to(device=keys.device, dtype=dtype))
        counts = weights.sum(dim=1)
        # On CUDA, half-precision keys are centred in float32, rounded back and multiplied on the tensor cores with
        # float32 sums (the axes only shape the boxes: a rounding of the centred keys barely turns them); float32
        # products take ~15x longer there.
        tensor_cores = keys.is_cuda and keys.dtype in (torch.float16, torch.bfloat16)
        for request in range(batch_size):  # one covariance per request (padding differs), no host sync
            weight = weights[request].view(1, length, 1)
            real = keys[request].to(dtype)
            mean = (real * weight).sum(dim=1, keepdim=True) / counts[request].clamp(min=1)
            centred = (real - mean) * weight
            if tensor_cores:
                centred = centred.to(keys.dtype)
                covariance[request] = torch.bmm(centred.transpose(1, 2), centred, dtype)
            else:
                torch.bmm(centred.transpose(1, 2), centred, out=covariance[request])
        axes = symmetric_eigenvectors(covariance.flatten(0, 1)).view_as(covariance)
        identity = torch.eye(head_dim, dtype=dtype, device=keys.device)
        return cls(torch.where((counts == 0).view(batch_size, 1, 1, 1), identity, axes))

    @property
    def nbytes(self) -> int:
        return self.matrix.numel() * self.matrix.element_size()

    def chunk(self, keys: torch.Tensor) -> torch.Tensor:
        """``keys [B, H, T, D]`` in the rows' axes: the basis' dtype's product, rounded to the keys' dtype where
        that is below float32 (the page boxes keep it). As :meth:`token` turns a key (a product in the basis' dtype,
        rounded where the boxes store it), so a page's box is the same whether its keys came in a chunk or one by
        one (a crop refolds a page from its keys in a chunk)."""
        turned = torch.matmul(keys.to(self.matrix.dtype), self.matrix)
        return turned.to(keys.dtype) if keys.element_size() < 4 else turned

    def token(self, keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row, ``keys [B, H, D]``, in the rows' axes (into ``out [B, H, D]`` when given: a
        CUDA graph's static buffer)."""
        batch_size, num_heads, head_dim = keys.shape
        rows = keys.to(self.matrix.dtype).reshape(batch_size * num_heads, 1, head_dim)
        target = None if out is None else out.view(batch_size * num_heads, 1, head_dim)
        return torch.bmm(rows, self.matrix.flatten(0, 1), out=target).view(batch_size, num_heads, head_dim)

    def rows(self, query: torch.Tensor, heads: torch.Tensor | None = None, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Queries ``[B * h, G, D]`` of the KV heads ``heads`` (``None``: all ``H``) in their rows' axes (into
        ``out`` when given)."""
        matrix = self.matrix if heads is None else self.matrix.index_select(1, heads)
        return torch.bmm(query.to(self.matrix.dtype), matrix.flatten(0, 1), out=out)

    def select(self, indices: torch.Tensor) -> KeyBasis:
        """The basis of requests ``indices [B']``, in that order (batch selection and repetition)."""
        return KeyBasis(self.matrix.index_select(0, indices.to(self.matrix.device)))
