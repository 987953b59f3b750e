"""Attention across training: one run per checkpoint of a training, on the same texts, ordered by step.

Takes checkpoints (a Trainer's ``checkpoint-*`` folders, checkpoint folders, or hub revisions).  Gives ordinary
runs that record their step (:func:`probe.training.series.run_series`, ``probe series``), which ``probe
compare`` draws against the step.  The Trainer callback that measures during training is
:mod:`probe.callbacks`.
"""
