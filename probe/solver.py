"""``probe.solver``: the stable public path of the batched, certified dual solver.

The path to import from (``from probe.solver import ...``): it re-exports the public names of
:mod:`probe.solve.dual`, where the code lives beside the other solvers and where probe's own modules import
it from.
"""

from probe.solve.dual import *  # noqa: F403 (the names of its __all__)
from probe.solve.dual import __all__  # noqa: F401
