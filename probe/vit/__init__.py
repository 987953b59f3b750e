"""The OT-ViT experiment: OT attention (eq. 22) as a layer, ViT / OT-ViT / Sinkhorn-ViT / exact-ViT, offline
data, training.

* :mod:`probe.vit.attention` -- softmax, OT (through :func:`probe.solve.ot.ot_attention`), Sinkhorn and exact
  attention (through :func:`probe.solve.exact.exact_attention`);
* :mod:`probe.vit.model`     -- the ViT (``ViTConfig``, ``ViT``, ``parameter_count``);
* :mod:`probe.vit.data`      -- Fashion-MNIST idx files, CIFAR-10/100 python batches;
* :mod:`probe.vit.train`     -- one resumable training run (checkpoints, results file);
* :mod:`probe.vit.loop`      -- its steps: the data on the device, no host sync per step, the plateau rule;
* :mod:`probe.vit.cli`       -- the typer sub-app (``probe vit train``).

Public contract for analyses of a trained OT-ViT::

    model, info = load_checkpoint(path)          # a run's model.pt or checkpoint.pt (or its directory)
    problems = final_layer_problems(model, images)
    p = probe.ot.ot_attention(problems["candidates"], problems["source_weights"], problems["cost"],
                              problems["evidence"], problems["alpha"], problems["gamma"])   # (B, H, N)

This module imports torch only when these functions are called (the CLI's option errors stay instant).
"""

from __future__ import annotations

from pathlib import Path

from probe.vit.problems import final_layer_problems

__all__ = ["load_checkpoint", "final_layer_problems"]


def load_checkpoint(path, map_location="cpu"):
    """Load a trained model: ``path`` is a run directory, its ``model.pt`` or its ``checkpoint.pt``.

    Returns ``(model, info)``: the :class:`probe.vit.model.ViT` in eval mode and a dict with ``config``,
    ``settings`` and (from a checkpoint) ``epoch`` and ``history``.  The file is read with
    ``torch.load(weights_only=True)`` (:func:`probe.vit.train.read_checkpoint`): one that holds any other Python
    object is refused.
    """
    from probe.core.errors import ProbeError
    from probe.vit.model import ViT, ViTConfig
    from probe.vit.train import CHECKPOINT, MODEL, read_checkpoint

    path = Path(path)
    if path.is_dir():
        path = path / MODEL if (path / MODEL).exists() else path / CHECKPOINT
    if not path.is_file():
        raise ProbeError(f"{path} does not exist: give a run directory of `probe vit train`, or its model.pt.")
    saved = read_checkpoint(path, "Give the model.pt or checkpoint.pt of a `probe vit train` run.", map_location)
    try:
        config = ViTConfig(**saved["config"])
    except Exception as error:  # noqa: BLE001
        raise ProbeError(
            f"cannot read {path} as a `probe vit train` model ({type(error).__name__}: {error})."
        ) from None
    model = ViT(config)
    model.load_state_dict(saved["model"])
    model.eval()
    info = {k: saved.get(k) for k in ("config", "settings", "epoch", "history")}
    return model, info
