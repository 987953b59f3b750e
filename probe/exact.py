"""``probe.exact``: the stable public path of exact inference as a differentiable layer (the KL problem's posterior with implicit gradients).

The path to import from (``from probe.exact import ...``): it re-exports the public names of
:mod:`probe.solve.exact`, where the code lives beside the other solvers and where probe's own modules import
it from.
"""

from probe.solve.exact import *  # noqa: F403 (the names of its __all__)
from probe.solve.exact import __all__  # noqa: F401
