r"""T5 encoder-decoders (T5, flan-T5, mT5, umT5): encoder self-, decoder (causal) self- and cross-attention.

Every attention module of the family is a ``T5Attention`` (``MT5Attention``, ``UMT5Attention``).  The
input of its key projection ``k`` is the output of the ``T5LayerNorm`` in front of it, the state ``x``
entering attention; for cross-attention it is the encoder's final output.  T5 logits are

.. math::  q\cdot k_i + b_{h}(i - j) + m_{ji}, \qquad q = W_q x_j,\ k_i = W_k x_i,

with **no** :math:`1/\sqrt{d'}` (``T5Attention.scaling == 1``), no q/k biases, the relative position bias
:math:`b` and the additive mask :math:`m` (padding keys, and future keys in the decoder).  With
:math:`t_i = x_i/\sqrt{d'}` and :math:`z = \sqrt{d'}\,W_k^\top q` we get :math:`\langle t_i, z\rangle =
q\cdot k_i`, so :math:`\log u_i = b_h(i - j) + m_{ji}` (``-inf`` where the mask excludes the key)
reproduces the logits exactly.

How transformers v5 runs it (``transformers/models/t5/modeling_t5.py``): ``T5Attention.forward`` passes
the bias to the attention interface as the ``position_bias`` keyword and the mask as ``attention_mask``;
the family's ``eager_attention_forward`` adds both to ``scaling * q.k``.  T5 and mT5 compute the bias in
layer 0 of each stack (``compute_bias``) and share it with the later layers; umT5 gives every layer its
own bias table; cross-attention passes a zero bias.  Either way the bias recorded is the tensor the
attention function added.  Captured through :mod:`probe.capture.adapters.generic`; decoder input by teacher
forcing (:meth:`probe.capture.adapters.generic.InterfaceAdapter.encode`).
"""

from __future__ import annotations

from probe.capture.adapters.generic import ENCODER_DECODER, Family, InterfaceAdapter

T5 = Family(
    name="t5",
    inputs=ENCODER_DECODER,
    sites={
        "encoder_self": r"(^|\.)encoder\.block\.\d+\.layer\.0\.SelfAttention$",
        "decoder_self": r"(^|\.)decoder\.block\.\d+\.layer\.0\.SelfAttention$",
        "cross": r"(^|\.)decoder\.block\.\d+\.layer\.1\.EncDecAttention$",
    },
    key="k",
    notes={
        "evidence": "hidden: z = sqrt(d') W_k^T q; key: z = sqrt(d') q; q = W_q x (per head; T5 has no q/k biases and "
        "no 1/sqrt(d') scaling: scaling = 1)",
        "preference": "log u_i = relative position bias[head, query, i] as passed to the attention function (t5, mt5: "
        "computed by layer 0 of each stack and shared by later layers; umt5: one per layer) + attention mask, -inf "
        "for padding keys and, in the decoder, future keys (causal); cross-attention has no position bias: u uniform "
        "over the real source tokens",
        "logit_identity": "alpha <t_i, z> + log u_i = q.k_i + position_bias + mask (alpha = 1)",
    },
)


class T5Adapter(InterfaceAdapter):
    model_types = ("t5", "mt5", "umt5")
    attention_types = ("encoder_self", "decoder_self", "cross")
    family = T5
