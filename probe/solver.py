"""``probe.solver``: the batched, certified dual solver's public names, for ``from probe.solver import ...``.

The path to import from (``from probe.solver import ...``): it re-exports the public names of
:mod:`probe.solve.dual`, where the code lives beside the other solvers and where probe's own modules import
it from.
"""

from probe.solve.dual import *  # noqa: F403 (the names of its __all__)
from probe.solve.dual import __all__  # noqa: F401
