"""The final layer's class-token attention of a trained ViT as OT problems (test time), for analyses of a
trained OT-ViT; torch is imported when the function is called."""

from __future__ import annotations


def final_layer_problems(model, images) -> dict:
    """The OT problems of the final layer's class-token query (test time: candidates = the image's templates).

    ``images (B, C, H, W)``, already normalised as in training (``ImageData.normalise``).  Returns
    ``candidates (B, H, N, dh)`` (the final layer's keys), ``source_weights (B, H, n)`` (uniform),
    ``cost (B, H, n, N)`` (the model's cost, ``M(t_j, t) = C - <t_j, t> >= 0`` by default), ``evidence (B, H, dh)``
    (the class-token queries), ``values (B, H, N, dh)``, and floats ``alpha``, ``gamma``, such that
    ``probe.solve.ot.ot_attention(candidates, source_weights, cost, evidence, alpha, gamma)`` is the model's
    final-layer class-token attention ``(B, H, N)``.  Works for any attention kind of the model (the problems
    are those an OT layer with the same queries and keys would solve); the model's own weights equal them
    only for the OT-ViT.
    """
    import torch

    was_training = model.training
    model.eval()  # no dropout: the test-time problems
    with torch.no_grad():
        block = model.blocks[-1]
        attn = block.attn
        q, k, v = attn.split(block.norm1(model.hidden_before_final(images)))
        B, H, n, dh = k.shape
        model.train(was_training)
        return {
            "candidates": k,
            "source_weights": torch.full((B, H, n), 1.0 / n, dtype=k.dtype, device=k.device),
            "cost": attn.cost(k, k),
            "evidence": q[:, :, 0],
            "values": v,
            "alpha": float(attn.alpha),
            "gamma": float(attn.gamma),
        }
