"""The ground floor: errors, settings and names that every stage shares, importable without torch.

Takes nothing from the rest of probe.  Gives :class:`~probe.core.errors.ProbeError`, a run's settings
(:class:`~probe.core.config.RunConfig`), the deviations table's columns (:mod:`probe.core.schema`), run and
model names (:mod:`probe.core.naming`), option spelling, progress lines and the version.
"""
