"""A run from start to end: checks first, then dataset -> batches -> rows -> part files, resume and verify.

Takes a :class:`~probe.core.config.RunConfig`.  Gives a finished (or resumable) run directory:
:func:`~probe.pipeline.runner.run` and :func:`~probe.pipeline.runner.resume` (:mod:`probe.pipeline.runner`), the checks that run before anything
expensive (:mod:`probe.pipeline.validate`), ``probe verify`` (:mod:`probe.pipeline.verify`), and several
processes under torchrun (:mod:`probe.pipeline.distributed`).
"""

__all__ = ["run", "resume"]


def __getattr__(name: str):
    """``run`` and ``resume`` from :mod:`probe.pipeline.runner`, imported on first use (it loads torch)."""
    if name in __all__:
        from probe.pipeline import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'probe.pipeline' has no attribute {name!r}")
