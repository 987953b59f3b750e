r"""Gemma 2 and Gemma 3: the generic capture, for the configs whose attention has probe's logit form.

Gemma 2's attention can pass its logits through *soft-capping* before the softmax
(``models/gemma2/modeling_gemma2.py``, ``eager_attention_forward`` with ``softcap=attn_logit_softcapping``):

.. math::  a_j = \mathrm{softmax}_i\big(\log u_i + \kappa \tanh(s_{ji} / \kappa)\big),
           \qquad s_{ji} = \text{scaling}\; q_j\cdot k_i

with the cap :math:`\kappa` = ``attn_logit_softcapping`` (50 in the released Gemma 2 checkpoints).
probe's problem (docs/math.md) reads attention as :math:`\mathrm{softmax}(\log u + \alpha\langle t, z\rangle)`
with an evidence :math:`z` that enters linearly; :math:`\kappa\tanh(s/\kappa)` is not linear in
:math:`s`, so no templates and evidence give these weights, and the dual problem, its solution and the
deviation :math:`\|\lambda^* - \alpha z\|` have no meaning there.  A config that sets
``attn_logit_softcapping`` is therefore refused, by name and before the model loads
(:meth:`UncappedAdapter.model_class`); a soft-cap that reaches the attention function anyway is
refused there too (:func:`probe.capture.adapters.interface.unrepresentable`).

Without soft-capping (``attn_logit_softcapping: null``: every Gemma 3 checkpoint, which normalises
queries and keys instead) the attention is the rotary decoder's
:math:`\mathrm{softmax}(\text{scaling}\; q\cdot k_i + \text{mask})`, with the q/k norms and rotary encoding
inside :math:`q` and :math:`k` (as the attention function receives them), ``scaling`` =
``query_pre_attn_scalar``:math:`^{-1/2}` (not :math:`1/\sqrt{d'}` in general: the evidence is
:math:`z = c\,q` with :math:`c = \text{scaling}\sqrt{d'}`) and the sliding-window layers' windows in the
mask.  Those configs run on the generic capture unchanged.  A Gemma 3 config that sets
``attn_logit_softcapping`` is refused like Gemma 2's: transformers' Gemma 3 attention does not pass the cap
to the attention function, so such a config declares a soft-capped attention that the model does not
compute, and probe measures neither reading of it.

Gemma 3's ``use_bidirectional_attention`` (the EmbeddingGemma encoders) drops the causal mask, so its
sites would be attention type ``causal_self`` without being causal; such a config is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from probe.capture.adapters.generic import Family, InterfaceAdapter
from probe.core.errors import ProbeError


def soft_capping_refusal(family: str, cap: float) -> str:
    """Why a config with attention logit soft-capping ``cap`` cannot be measured (one line)."""
    return (
        f"probe cannot measure this {family} model: its config sets attn_logit_softcapping = {cap}, so its attention "
        f"is softmax(log u + {cap} * tanh(s / {cap})) with s = scaling * q.k, and soft-capping is not linear in the "
        "evidence: no templates and evidence give softmax(log u + alpha <t, z>), so the dual problem probe solves "
        "does not describe this attention. Gemma checkpoints without soft-capping (Gemma 3, Gemma 1) are supported; "
        "setting attn_logit_softcapping to null in config.json would measure a different model."
    )


class UncappedAdapter(InterfaceAdapter):
    """The generic adapter, refusing a config with attention logit soft-capping or bidirectional attention
    before the model loads (see the module docstring)."""

    def model_class(self, config):
        text = config.get_text_config()  # the multimodal Gemma 3 keeps its language model's entries there
        cap = getattr(text, "attn_logit_softcapping", None)
        if cap is not None:
            raise ProbeError(soft_capping_refusal(self.family.name, cap))
        if getattr(text, "use_bidirectional_attention", False):
            raise ProbeError(
                f"probe cannot measure this {self.family.name} model: its config sets use_bidirectional_attention "
                "(an EmbeddingGemma-style encoder), but probe declares this family as a causal decoder (attention "
                "type causal_self). Run a causal Gemma checkpoint."
            )
        return super().model_class(config)


@dataclass(frozen=True, eq=False)
class UncappedFamily(Family):
    """A :class:`Family` whose configs may set attention logit soft-capping: its adapter is an
    :class:`UncappedAdapter`, which refuses those configs."""

    def __call__(self) -> UncappedAdapter:
        return UncappedAdapter(self)
