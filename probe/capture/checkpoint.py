"""A checkpoint's weights read with what can go wrong as one-paragraph
:class:`~probe.core.errors.ProbeError` messages: a corrupt or incomplete file, a pickled file refused as unsafe
(pickled weights load weights-only), weights of other shapes than the config asks for, weights the model needs
that the checkpoint lacks.  Used by the adapters' ``load_model`` (:mod:`probe.capture.adapters.base`), below
:mod:`probe.capture.loading`, which calls the adapters: so the dependency runs one way."""

from __future__ import annotations

import pickle
import re

from probe.core.errors import ProbeError, first_line

#: Parts of a checkpoint that probe never uses: missing from a checkpoint, they do not matter (a
#: BertModel loaded from a masked-LM checkpoint has no pooler weights, for example).
UNUSED_MODULES = ("pooler", "lm_head", "cls", "classifier", "qa_outputs", "score")


def from_pretrained_checked(loader, name_or_path: str, **kwargs):
    """``loader.from_pretrained(name_or_path, **kwargs)``, with weight problems as ProbeErrors.

    transformers 5 only warns (with a long table) about weights the checkpoint lacks, and raises a
    RuntimeError after the table for weights of the wrong shape.  Here the load report is silenced and
    read instead: mismatched shapes and missing weights outside :data:`UNUSED_MODULES` are errors
    (missing weights would be random), and a corrupt file is reported in one paragraph.
    """
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = loader.from_pretrained(
            name_or_path, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
    except ProbeError:
        raise
    except Exception as error:  # safetensors, torch.load, OSError, RuntimeError: all say "cannot read"
        if is_unsafe_pickle(error):
            raise ProbeError(unsafe_pickle_message(name_or_path, error)) from None
        raise ProbeError(
            f"Could not load the weights of '{name_or_path}': {type(error).__name__}: {first_line(error)}. "
            "The weights file is corrupt or incomplete (an interrupted download or copy?): copy or download "
            "the model again."
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    # an attention weight matrix first, as the example: that is what probe measures
    mismatched = sorted(
        info.get("mismatched_keys") or [], key=lambda m: ("attention" not in m[0].lower(), len(m[1]) != 2, m[0])
    )
    if mismatched:
        key, checkpoint_shape, model_shape = mismatched[0]
        raise ProbeError(
            f"The weights of '{name_or_path}' do not match its config.json: {len(mismatched)} tensors have "
            f"other shapes than the config asks for, e.g. '{key}' is {tuple(checkpoint_shape)} in the "
            f"checkpoint but {tuple(model_shape)} for the config. The config and the weights come from "
            "different models: put the config.json that was saved with these weights beside them."
        )
    missing = sorted(
        key for key in info.get("missing_keys") or [] if not set(key.split(".")) & set(UNUSED_MODULES)
    )
    if missing:
        raise ProbeError(
            f"The checkpoint of '{name_or_path}' lacks {len(missing)} weights the model needs, e.g. "
            f"{', '.join(repr(key) for key in missing[:3])}: they would be random, and so would the attention "
            "probe measures. The weights file does not belong to this config.json (or is incomplete)."
        )
    return model




def is_unsafe_pickle(error: BaseException) -> bool:
    """Whether ``error`` is ``torch.load(weights_only=True)`` refusing a pickle (``pytorch_model.bin``) that
    would import or call something other than tensors' constructors: code it would run when unpickled."""
    return isinstance(error, pickle.UnpicklingError) and str(error).lower().startswith("weights only load failed")


def unsafe_pickle_message(name_or_path: str, error: BaseException) -> str:
    """What to say when :func:`is_unsafe_pickle`: the file was refused, not damaged; what it asked for (torch
    names the global, e.g. ``posix.system``), and that safetensors holds tensors only."""
    found = re.search(r"(?:unsupported GLOBAL|Unsupported global: GLOBAL) ([\w.]+)", str(error))
    asked = f" (it asks for {found.group(1)})" if found else ""
    return (
        f"The weights of '{name_or_path}' were refused as unsafe: its pickled weights file (pytorch_model.bin) "
        f"would import or run code when loaded{asked}, and probe loads pickled weights weights-only "
        "(torch.load(weights_only=True)), which allows tensors and nothing else. The file is not damaged. Use "
        "the model in safetensors instead (model.safetensors, which holds tensors only): the model's own copy, or "
        "one that save_pretrained writes from a copy you trust."
    )
