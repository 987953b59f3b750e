"""ViT, OT-ViT, Sinkhorn-ViT and exact-ViT in plain torch: identical except the final layer's attention.

Patches by ``unfold`` (4x4, no overlap) and a linear embedding, a class token, a learned positional
embedding, pre-norm blocks (``x + attn(LN(x))``, ``x + MLP(LN(x))``, GELU), dropout, a final LayerNorm and a
linear head on the class token.  The paper's sizes: 6 layers, width 256, MLP 512, dropout 0.2 (the reading
of "hidden dimension 512" that gives its 3.2M parameters: 3,183,114 here; width 512 with an MLP of
2048 would give about 19M, width 512 with an MLP of 512 about 9.5M).  Heads: 8 of
dimension 32 (``heads * head_dim = width``, the usual choice; the parameter count does not depend on the
split, only on ``heads * head_dim``).  :func:`parameter_count` gives the count from the config alone.

Only the class token's output of the final layer feeds the head, so the final block evaluates its attention
and MLP for the class token alone (exact for the logits; for Sinkhorn the attention is computed for all
queries, which its column normalisation couples, and the class token's row is kept).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn

from probe.vit.attention import MultiHeadAttention

__all__ = ["ViTConfig", "ViT", "parameter_count"]


@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 28
    channels: int = 1
    num_classes: int = 10
    patch: int = 4
    dim: int = 256
    depth: int = 6
    heads: int = 8
    head_dim: int = 32
    mlp_dim: int = 512
    dropout: float = 0.2
    attention: str = "softmax"  # the final layer's: softmax | ot | sinkhorn | exact
    alpha: float = 1.0  # OT and exact
    gamma: Optional[float] = None  # OT (and exact's template scale k / gamma); None = sqrt(head_dim)
    sinkhorn_iterations: int = 3

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch) ** 2 + 1

    def to_dict(self) -> dict:
        return asdict(self)


def parameter_count(config: ViTConfig) -> int:
    """The number of trainable parameters of :class:`ViT` with ``config``, from the formula (no allocation).

    Patch embedding ``(C p^2 + 1) d``, class token ``d``, positions ``T d`` (``T`` = patches + 1); per block two
    LayerNorms ``4 d``, ``qkv`` ``(d + 1) 3 h e``, output ``(h e + 1) d``, MLP ``(d + 1) m + (m + 1) d``; the final
    LayerNorm ``2 d`` and the head ``(d + 1) K``.  The attention kind adds nothing.
    """
    c = config
    d, he, m = c.dim, c.heads * c.head_dim, c.mlp_dim
    block = 4 * d + (d + 1) * 3 * he + (he + 1) * d + (d + 1) * m + (m + 1) * d
    return (c.channels * c.patch**2 + 1) * d + d + c.tokens * d + c.depth * block + 2 * d + (d + 1) * c.num_classes


class Block(nn.Module):
    def __init__(self, config: ViTConfig, kind: str = "softmax"):
        super().__init__()
        c = config
        self.norm1 = nn.LayerNorm(c.dim)
        self.attn = MultiHeadAttention(
            c.dim, c.heads, c.head_dim, kind, c.dropout, c.alpha, c.gamma, sinkhorn_iterations=c.sinkhorn_iterations
        )
        self.norm2 = nn.LayerNorm(c.dim)
        self.mlp = nn.Sequential(
            nn.Linear(c.dim, c.mlp_dim), nn.GELU(), nn.Dropout(c.dropout), nn.Linear(c.mlp_dim, c.dim), nn.Dropout(c.dropout)
        )

    def forward(self, x, extra=None, extra_mask=None, query_index=None):
        h = self.norm1(x)
        extra_h = None if extra is None else self.norm1(extra)
        a = self.attn(h, None, extra_h, extra_mask, query_index)
        if query_index is not None:
            x = x[:, query_index : query_index + 1]
        x = x + a
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """``forward(images, extra_images=None, extra_mask=None) -> logits (B, K)``.

    ``extra_images (B, C, H, W)`` with ``extra_mask (B,)`` bool: for the OT model in training, the images whose
    final-layer templates join sample ``b``'s candidate set when ``extra_mask[b]`` (the paper's trick; rows
    with a False mask are ignored).  The extra images go through the first ``depth - 1`` blocks in the same
    batch as the inputs (gradients flow through both).

    With ``extra_index (k,)`` (the positions where ``extra_mask`` is True, found beforehand), ``extra_images``
    holds only those ``k`` partners, in that order: the same computation, with the same dropout draws, and no
    host sync (the mask is not read on the host).  ``k`` may be 0.
    """

    def __init__(self, config: ViTConfig):
        super().__init__()
        c = self.config = config
        if c.image_size % c.patch:
            raise ValueError(f"image size {c.image_size} is not a multiple of the patch size {c.patch}")
        self.unfold = nn.Unfold(kernel_size=c.patch, stride=c.patch)
        self.embed = nn.Linear(c.channels * c.patch**2, c.dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, c.dim))
        self.pos = nn.Parameter(torch.randn(1, c.tokens, c.dim) * 0.02)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            [Block(c, "softmax") for _ in range(c.depth - 1)] + [Block(c, c.attention)]
        )
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.num_classes)

    def hidden_before_final(self, images: torch.Tensor) -> torch.Tensor:
        """The hidden states entering the final block, ``(B, T, dim)``."""
        patches = self.unfold(images).transpose(1, 2)  # (B, L, C p^2)
        x = self.embed(patches)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.drop(x)
        for block in self.blocks[:-1]:
            x = block(x)
        return x

    def forward(self, images, extra_images=None, extra_mask=None, extra_index=None):
        extra = None
        if extra_index is not None:  # the trick with its partners chosen beforehand: no host sync
            return self._forward_chosen(images, extra_images, extra_mask, extra_index)
        if extra_images is not None and extra_mask is not None and bool(extra_mask.any()):
            if self.config.attention != "ot":
                raise ValueError("extra candidates (the training trick) exist only for the OT-ViT")
            chosen = extra_mask.nonzero().squeeze(1)
            h = self.hidden_before_final(torch.cat([images, extra_images[chosen]]))
            x, h_extra = h[: images.shape[0]], h[images.shape[0] :]
            extra = x.new_zeros(x.shape).index_copy(0, chosen, h_extra)
            token_mask = extra_mask[:, None].expand(-1, x.shape[1])
        else:
            x = self.hidden_before_final(images)
            token_mask = None
        x = self.blocks[-1](x, extra, token_mask, query_index=0)  # (B, 1, dim): the class token
        return self.head(self.norm(x[:, 0]))

    def _forward_chosen(self, images, extra_images, extra_mask, extra_index):
        if self.config.attention != "ot":
            raise ValueError("extra candidates (the training trick) exist only for the OT-ViT")
        if extra_images.shape[0] == 0:
            return self.head(self.norm(self.blocks[-1](self.hidden_before_final(images), query_index=0)[:, 0]))
        h = self.hidden_before_final(torch.cat([images, extra_images]))
        x, h_extra = h[: images.shape[0]], h[images.shape[0] :]
        extra = x.new_zeros(x.shape).index_copy(0, extra_index, h_extra)
        token_mask = extra_mask[:, None].expand(-1, x.shape[1])
        x = self.blocks[-1](x, extra, token_mask, query_index=0)
        return self.head(self.norm(x[:, 0]))
