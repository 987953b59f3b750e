"""Loading a model for probe: config, adapter, model (eager attention) and tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .adapters import adapter_for
from .errors import ProbeError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    adapter: object
    model: torch.nn.Module
    tokenizer: object
    info: dict


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ProbeError(f"Unknown device '{device}'. Use auto, cpu, cuda or cuda:N.") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ProbeError(f"Device '{device}' asked for, but CUDA is not available here. Use --device cpu.")
    return resolved


def _device_map(device: str, init: str) -> str | None:
    """``"auto"`` (shard the model over every visible GPU, with accelerate) when ``device`` is auto and more
    than one GPU is visible; ``None`` (one device) otherwise."""
    if device != "auto" or not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    if init == "random":
        raise ProbeError(
            f"--init random builds the model on one device, but {torch.cuda.device_count()} GPUs are visible and "
            "--device auto would shard it. Pass --device cuda:0 (or set CUDA_VISIBLE_DEVICES)."
        )
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise ProbeError(
            f"{torch.cuda.device_count()} GPUs are visible: probe shards the model over them with device_map='auto', "
            "which needs the accelerate package (pip install 'probe[large]'). Or pass --device cuda:0."
        )
    return "auto"


def load_model(
    name: str, *, revision: str | None = None, dtype: str = "float32", device: str = "auto",
    init: str = "pretrained", seed: int = 0,
) -> LoadedModel:
    """Load config, adapter, model (eager attention) and tokenizer for a hub id or local directory.

    ``init="random"`` builds the same architecture with fresh weights instead (the random-init
    control, :meth:`probe.adapters.base.Adapter.init_model`); the tokenizer still comes from the checkpoint.
    """
    from transformers import AutoConfig, AutoTokenizer

    if dtype not in DTYPES:
        raise ProbeError(f"Unknown dtype '{dtype}'. Choose one of: {', '.join(DTYPES)}.")
    resolved = _resolve_device(device)  # before the (slow) load, so that a bad --device fails at once
    device_map = _device_map(device, init)
    path = Path(name).expanduser()
    if path.exists() and not (path / "config.json").exists():
        raise ProbeError(
            f"'{name}' is a local path but has no config.json: it is not a Hugging Face model directory. "
            "Pass a directory written by save_pretrained, or a hub model id."
        )
    try:
        config = AutoConfig.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as error:
        raise ProbeError(
            f"Could not load model '{name}': {str(error).splitlines()[0]}\n"
            "Pass a local model directory (one written by save_pretrained), or check the model id and your "
            "connection to the Hugging Face Hub (offline? set HF_HUB_OFFLINE=1 and use a cached or local model)."
        ) from None
    adapter = adapter_for(config.model_type)
    saved_implementation = getattr(config, "_attn_implementation", None)
    config._attn_implementation = "eager"
    try:
        if init == "random":
            model = adapter.init_model(config, dtype=DTYPES[dtype], seed=seed)
        else:
            model = adapter.load_model(
                name, config=config, revision=revision, dtype=DTYPES[dtype], device_map=device_map
            )
        tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as error:
        raise ProbeError(
            f"Could not load the weights or tokenizer of '{name}': {str(error).splitlines()[0]}\n"
            "A model directory needs its weights and tokenizer files; for a hub id, check your connection."
        ) from None
    if model.config._attn_implementation != "eager":
        raise ProbeError(
            f"'{name}' loaded with {model.config._attn_implementation} attention, which hides attention "
            "probabilities; probe needs eager attention. Remove _attn_implementation from its config.json."
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
        "init": init,
        "init_seed": seed if init == "random" else None,
        "device_map": {k: str(v) for k, v in model.hf_device_map.items()} if device_map else None,
    }
    return LoadedModel(adapter=adapter, model=model, tokenizer=tokenizer, info=info)
