r"""A factor :math:`A` with :math:`AA^\top = G = TT^\top` for each group, the form in which the solvers
take the templates.  From the Gram matrix (:func:`factor_gram`): batched Cholesky where :math:`G` is
positive definite, the eigendecomposition where it is not (duplicate templates, more templates than
dimensions).  From the templates themselves (:func:`factor_from_templates`): :math:`T`, or its QR
reduction, with no :math:`n \times n` matrix at all, for long contexts.  Notation: :mod:`probe.solve.dual`."""

from __future__ import annotations

import torch


def used_columns(factor: torch.Tensor) -> torch.Tensor:
    r"""The columns of a factor ``(g, n, r)`` that are nonzero in some group, ``(r,)`` bool (none where there are
    no groups or no keys).  :func:`factor_gram` zeroes the columns of null eigenvalues, and a column zero in every
    group plays no part in a solve: the solvers drop them.  One reduction along the factor's contiguous rows (4x
    faster than ``any`` over the flattened groups and keys)."""
    if not factor.shape[0] * factor.shape[1]:
        return torch.zeros(factor.shape[-1], dtype=torch.bool, device=factor.device)
    return factor.abs().amax(dim=(0, 1)) != 0


def factor_gram(gram: torch.Tensor, method: str = "cholesky") -> torch.Tensor:
    r"""Return :math:`A` with :math:`AA^\top = G` for each Gram matrix in ``(g, n, n)``.

    ``method="cholesky"`` (the default): the Cholesky factor where :math:`G` is positive definite, the
    eigendecomposition for the other groups only (:func:`factor_cholesky`); a tenth of the
    eigendecomposition's time on a CPU at 128 keys, and batched on a GPU, where the eigendecomposition runs
    one matrix at a time.  ``method="eigh"``: :math:`A = Q\Gamma^{1/2}` from the eigendecomposition.
    Eigenvalues below ``n * eps * max_eigenvalue`` (rounding noise of a rank-deficient :math:`G`, e.g.
    duplicate templates) are treated as exact zeros; the corresponding columns of :math:`A` are zero.  Any
    :math:`A` with :math:`AA^\top = G` gives the same problem (R-D), up to an orthogonal change of :math:`y`.
    """
    if method == "cholesky":
        return factor_cholesky(gram)
    if method != "eigh":
        raise ValueError(f"method must be 'eigh' or 'cholesky', got {method!r}")
    gram = 0.5 * (gram + gram.transpose(-1, -2))
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    n = gram.shape[-1]
    top = eigenvalues.abs().amax(dim=-1, keepdim=True)
    floor = n * torch.finfo(gram.dtype).eps * top
    kept = torch.where(eigenvalues > floor, eigenvalues, torch.zeros_like(eigenvalues))
    return eigenvectors * kept.sqrt().unsqueeze(-2)


def factor_cholesky(gram: torch.Tensor) -> torch.Tensor:
    r""":math:`A` with :math:`AA^\top = G` for each Gram matrix in ``(g, n, n)``, batched: the Cholesky
    factor :math:`L` (:math:`G = LL^\top`) of every group at once, and the eigendecomposition
    (:func:`factor_gram`, ``method="eigh"``) only for the groups where Cholesky fails or
    finds a pivot :math:`\ell_{kk}^2 \le n\,\epsilon\,\max_i G_{ii}`: numerically rank-deficient ones
    (duplicate templates, more keys than dimensions), whose null directions the eigendecomposition
    drops.  One read of the host (whether any group needs the eigendecomposition)."""
    gram = 0.5 * (gram + gram.transpose(-1, -2))
    factor, info = torch.linalg.cholesky_ex(gram)
    n = gram.shape[-1]
    floor = n * torch.finfo(gram.dtype).eps * gram.diagonal(dim1=-2, dim2=-1).amax(-1)
    pivots = factor.diagonal(dim1=-2, dim2=-1).square().amin(-1)
    deficient = (info != 0) | ~(pivots > floor)  # NaN pivots included
    if bool(deficient.any()):
        groups = deficient.nonzero().squeeze(-1)
        factor[groups] = factor_gram(gram[groups], method="eigh")
    return factor



def factor_from_templates(templates: torch.Tensor) -> torch.Tensor:
    r"""Return :math:`A` with :math:`AA^\top = TT^\top = G` for templates ``(..., n, d)``, without forming
    :math:`G`: ``(..., n, r)`` in float64 with :math:`r = \min(n, d)`.

    Where :math:`d \le n` (long contexts: more keys than dimensions) :math:`A = T` itself: the reduced
    dual (R-D) is then the dual (D) in its own coordinates.  Where :math:`d > n` the templates are
    QR-reduced, :math:`T^\top = QR` with :math:`Q` of orthonormal columns, so :math:`A = R^\top` is
    :math:`n \times n` (:math:`AA^\top = R^\top Q^\top Q R = TT^\top`).  Either way the cost is
    :math:`O(n d \min(n, d))` and the memory :math:`O(n d)`: no :math:`n \times n` Gram matrix and no
    eigendecomposition.  :math:`T` may be rank-deficient (duplicate or padding templates): any :math:`A`
    with :math:`AA^\top = G` gives the same problem (R-D), and (R-D) stays strongly concave.
    """
    templates = templates.to(torch.float64)
    n, d = templates.shape[-2:]
    if d <= n:
        return templates.contiguous()
    upper = torch.linalg.qr(templates.transpose(-1, -2), mode="r")[1]  # (..., n, n)
    return upper.transpose(-1, -2).contiguous()
