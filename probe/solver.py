"""``probe.solver``: the batched, certified dual solver's public names, for ``from probe.solver import ...``.

The canonical place of the solver is :mod:`probe.solve.dual` (with the other solvers in :mod:`probe.solve`);
probe's own modules and its documentation import from there.  This module re-exports its ``__all__``
unchanged, so that code written against ``probe.solver`` keeps working; new code should import from
:mod:`probe.solve.dual`.
"""

from probe.solve.dual import *  # noqa: F403 (the names of its __all__)
from probe.solve.dual import __all__  # noqa: F401
