"""From a model and texts to attention problems: loading, tokenising, and the per-family adapters.

Takes a hub id or model directory and a dataset.  Gives the loaded model in eager attention
(:mod:`probe.capture.loading`), the texts (:mod:`probe.capture.data`), and, while the model runs, each
attention site's templates, evidence and preference (:mod:`probe.capture.adapters`, one file per family).
"""
