"""Loading a model for probe: config, adapter, model (eager attention) and tokenizer.

What can go wrong while loading becomes a one-paragraph :class:`ProbeError`: a config.json that does
not parse, weights that do not fit the config (shape mismatch), weights the model needs that the
checkpoint lacks (they would be random), a corrupt weights file, a tokenizer without a vocabulary.
The cheap checks of the files themselves run earlier, in :mod:`probe.pipeline.validate`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from probe.core.errors import ProbeError, first_line
from probe.core.spelling import option

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: A sentence whose words any real vocabulary knows (a tokenizer that maps them all to the unknown
#: token has no vocabulary).
VOCABULARY_PROBE = "The quick brown fox jumps over the lazy dog."


@dataclass
class LoadedModel:
    adapter: object
    model: torch.nn.Module
    tokenizer: object
    info: dict


def resolve_device(device: str) -> torch.device:
    """The torch device for ``--device``: auto, cpu, cuda, cuda:N or mps, each only where it exists."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError):
        raise ProbeError(f"Unknown device '{device}'. Use auto, cpu, cuda, cuda:N or mps.") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ProbeError(f"Device '{device}' asked for, but CUDA is not available here. Use {option('device', 'cpu')}.")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise ProbeError(
                f"Device '{device}' asked for, but this machine has {count} CUDA device(s): "
                f"use cuda:0 to cuda:{count - 1}."
            )
        return resolved
    if resolved.type == "mps":
        if not torch.backends.mps.is_available():
            raise ProbeError(
                f"Device '{device}' asked for, but MPS (Apple GPU) is not available here. Use {option('device', 'cpu')}.")
        return resolved
    if resolved.type == "meta":
        raise ProbeError(
            "Device 'meta' holds shapes but no values, so nothing can be measured on it. Use "
            f"{option('device', 'cpu')} or cuda."
        )
    raise ProbeError(f"probe does not run on '{device}'. Use auto, cpu, cuda, cuda:N or mps.")


def device_name(device: str) -> str:
    """The device ``--device DEVICE`` loads the model onto, in words: ``auto`` becomes the one it picks
    (``cpu``, ``cuda:0 (NVIDIA H100 80GB HBM3)``, or every visible GPU when the model is sharded)."""
    if device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        return f"{torch.cuda.device_count()} GPUs (sharded by accelerate, device_map='auto')"
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        index = resolved.index if resolved.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(resolved)


class quiet_transformers:
    """transformers' own progress bars (its "Loading weights" bar) off meanwhile, whatever probe's
    ``--progress``: probe says what it loads itself, and the bar would break its lines (a log file gets
    carriage returns).  Its logging is left as it is: a warning about the checkpoint still shows."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self.was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc):
        if self.was_enabled:
            from transformers.utils import logging as hf_logging

            hf_logging.enable_progress_bar()


#: transformers' warnings about what probe does not use: a config's classification labels that disagree with
#: its ``num_labels`` (probe loads the model without its head), said each time the config is read
HANDLED_WARNINGS = {"transformers.configuration_utils": ("which is incompatible to the `id2label` map",)}


class HandledWarnings(logging.Filter):
    """Drops a logger's records whose message holds one of ``texts``: warnings about what probe handles."""

    def __init__(self, texts: tuple[str, ...]):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.texts)


def silence_handled_warnings() -> None:
    """Install :class:`HandledWarnings` on the loggers of :data:`HANDLED_WARNINGS`, once per process."""
    for name, texts in HANDLED_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(each, HandledWarnings) for each in logger.filters):
            logger.addFilter(HandledWarnings(texts))


def load_config(name: str, revision: str | None = None):
    """The model's transformers config, or a ProbeError that says why it cannot be read."""
    from transformers import AutoConfig

    silence_handled_warnings()
    try:
        return AutoConfig.from_pretrained(name, revision=revision)
    except (OSError, ValueError, KeyError) as error:  # a JSONDecodeError is a ValueError
        raise ProbeError(
            f"Could not read the config of model '{name}': {first_line(error)}. "
            "A model directory needs the config.json written by save_pretrained."
        ) from None


def load_tokenizer(source: str, revision: str | None = None):
    """The tokenizer at ``source`` (a model directory, a tokenizer directory or a hub id), checked to
    have a vocabulary: a directory without tokenizer files can still give a tokenizer object that maps
    every word to the unknown token, which would make every text the same."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, revision=revision)
    except Exception as error:  # tokenizers raise OSError, ValueError, Exception from the Rust side, ...
        raise ProbeError(
            f"Could not load the tokenizer from '{source}': {first_line(error)}. Pass a directory with the "
            f"model's tokenizer files (tokenizer.json, vocab.txt, spiece.model, ...) with {option('tokenizer')}."
        ) from None
    ids = tokenizer(VOCABULARY_PROBE, add_special_tokens=False)["input_ids"]
    unknown = getattr(tokenizer, "unk_token_id", None)
    if not ids or (unknown is not None and all(i == unknown for i in ids)):
        raise ProbeError(
            f"The tokenizer from '{source}' has no vocabulary: it turns every word of {VOCABULARY_PROBE!r} "
            f"into the unknown token, so every text would look the same to the model. Pass the model's "
            f"tokenizer with {option('tokenizer', 'PATH')}."
        )
    return tokenizer


def _device_map(device: str, init: str) -> str | None:
    """``"auto"`` (shard the model over every visible GPU, with accelerate) when ``device`` is auto and more
    than one GPU is visible; ``None`` (one device) otherwise."""
    if device != "auto" or not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    if init == "random":
        raise ProbeError(
            f"{option('init', 'random')} builds the model on one device, but {torch.cuda.device_count()} GPUs are "
            f"visible and {option('device', 'auto')} would shard it. Pass {option('device', 'cuda:0')} (or set "
            "CUDA_VISIBLE_DEVICES)."
        )
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise ProbeError(
            f"{torch.cuda.device_count()} GPUs are visible: probe shards the model over them with device_map='auto', "
            f"which needs the accelerate package (pip install 'probe[large]'). Or pass {option('device', 'cuda:0')}."
        )
    return "auto"


def load_model(
    name: str,
    *,
    revision: str | None = None,
    dtype: str = "float32",
    device: str = "auto",
    init: str = "pretrained",
    seed: int = 0,
    tokenizer: str | None = None,
) -> LoadedModel:
    """Load config, adapter, model (eager attention) and tokenizer for a hub id or local directory.

    ``init="random"`` builds the same architecture with fresh weights instead (the random-init
    control, :meth:`probe.capture.adapters.base.Adapter.init_model`); the tokenizer still comes from the checkpoint,
    or from ``tokenizer`` when it is not beside the model (``--tokenizer``).
    """
    from probe.capture.adapters import adapter_for
    from probe.capture.adapters.interface import ATTENTION
    from probe.capture.adapters.interface import register as register_attention

    if dtype not in DTYPES:
        raise ProbeError(f"Unknown dtype '{dtype}'. Choose one of: {', '.join(DTYPES)}.")
    resolved = resolve_device(device)  # before the (slow) load, so that a bad --device fails at once
    device_map = _device_map(device, init)
    path = Path(name).expanduser()
    if path.exists() and not (path / "config.json").exists():
        raise ProbeError(
            f"'{name}' is a local path but has no config.json: it is not a Hugging Face model directory. "
            "Pass a directory written by save_pretrained, or a hub model id."
        )
    config = load_config(name, revision)
    adapter = adapter_for(config.model_type)
    saved_implementation = getattr(config, "_attn_implementation", None)
    config._attn_implementation = register_attention()  # the family's eager attention, observable by probe
    try:
        with quiet_transformers():  # its "Loading weights" bar would break probe's lines
            if init == "random":
                model = adapter.init_model(config, dtype=DTYPES[dtype], seed=seed)
            else:
                model = adapter.load_model(
                    name, config=config, revision=revision, dtype=DTYPES[dtype], device_map=device_map
                )
    except (OSError, ValueError) as error:
        raise ProbeError(
            f"Could not load the weights of '{name}': {first_line(error)}. A model directory needs its "
            "weights (model.safetensors or pytorch_model.bin); for a hub id, check your connection."
        ) from None
    loaded_tokenizer = load_tokenizer(tokenizer or name, None if tokenizer else revision)
    if model.config._attn_implementation != ATTENTION:
        raise ProbeError(
            f"'{name}' loaded with {model.config._attn_implementation} attention, which hides attention "
            "probabilities; probe needs its eager attention. Remove _attn_implementation from its config.json."
        )
    model.eval()
    if device_map is None:
        model.to(resolved)
    info = {
        "id": name,
        "path": str(path.resolve()) if path.exists() else None,
        "revision": revision or getattr(config, "_commit_hash", None),
        "model_type": config.model_type,
        "architectures": getattr(config, "architectures", None),
        "class": type(model).__name__,
        "saved_attention_implementation": saved_implementation,
        "tokenizer": tokenizer,  # None: the model's own
        "init": init,
        "init_seed": seed if init == "random" else None,
        "device_map": {k: str(v) for k, v in model.hf_device_map.items()} if device_map else None,
    }
    return LoadedModel(adapter=adapter, model=model, tokenizer=loaded_tokenizer, info=info)
