"""Pure tensor math: the certified dual solvers, with no knowledge of models.

Takes batched problems (templates' Gram matrix, evidence, preference, alpha) as tensors.  Gives the exact
dual solution :math:`\\lambda^*` with its certificate (:mod:`probe.solve.dual`, its C kernel
:mod:`probe.solve.native`), the quantities derived from it (:mod:`probe.solve.second_order`,
:mod:`probe.solve.derived`), the exact posterior as a differentiable layer (:mod:`probe.solve.exact`), OT
attention (:mod:`probe.solve.ot`) and independent reference solvers for tests (:mod:`probe.solve.reference`).
"""
