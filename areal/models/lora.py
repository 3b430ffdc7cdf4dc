"""LoRA adapters on a Hugging Face causal LM (with PEFT): adding them, naming and moving their
tensors, the PEFT directory the engines load, and merging them into the base weights.

Contract:
- `add_adapters(model, cfg, seed)` injects LoRA layers in place (PEFT's
  `inject_adapter_in_model`): the model keeps its class and forward (the trainer's packed
  log-probs, FSDP wrapping and transformers' continuous batching see the same model), every
  base parameter is frozen, and only the adapters (`...q_proj.lora_A.default.weight`,
  `...lora_B...`) require grad. A is drawn from `seed` alone (PEFT's Kaiming init), B is
  zero: every trainer rank starts from the same adapters, and an engine serving version 0
  with zero B computes exactly the base model (base + 0).
- Tensors leave the model under PEFT's file names, `base_model.model.<module>.lora_A.weight`
  (what `PeftModel.save_pretrained` writes and vLLM loads): `adapter_tensors`, and
  `file_name` / `param_name` convert. `copy_adapters` checks every name and shape before
  the first byte is copied, and requires the whole adapter set.
- `save_adapter_dir` writes `adapter_config.json` and `adapter_model.safetensors`, each by
  temp file + rename (a reader sees a complete file or none); `is_adapter_dir` tells such a
  directory from a full checkpoint.
- `merge_into_base` returns base weights + (alpha / rank) * B @ A per adapted layer, under
  checkpoint names, computed in float32 from the untouched base checkpoint: no merge/unmerge
  round trip, so nothing drifts. Used for the final model only; engines apply adapters
  unmerged (see the rollout engines).

Not here: transport, version directories, optimisers.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from areal.config import LoraConfig
from areal.models.weights import WeightMismatchError

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_NAME = "default"
"""PEFT's name of the one adapter every model here carries."""
_FILE_PREFIX = "base_model.model."
_KINDS = ("lora_A", "lora_B")


class AdapterMismatchError(WeightMismatchError):
    """Adapter tensors do not fit the model's adapters (name, shape, or some missing)."""


def peft_config(cfg: LoraConfig, base_model: str | None = None):
    """The `peft.LoraConfig` of `cfg` (no task type: the model is not wrapped)."""
    import peft

    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=sorted(cfg.target_modules),
        bias="none",
        base_model_name_or_path=base_model,
    )


def add_adapters(model: nn.Module, cfg: LoraConfig, *, seed: int) -> nn.Module:
    """Inject LoRA layers into `model` in place and freeze everything else; returns it.

    Raises ValueError when no module matches `cfg.target_modules`.
    """
    from peft import inject_adapter_in_model

    if not cfg.enabled:
        raise ValueError("trainer.lora.rank is 0: there are no adapters to add")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER_NAME)
        except ValueError as err:
            raise ValueError(
                f"trainer.lora.target_modules={cfg.target_modules} matches no "
                f"layer of {type(model).__name__}: {err}"
            ) from None
    for name, param in model.named_parameters():
        param.requires_grad_(_is_adapter_param(name))
    return model


def has_adapters(model: nn.Module) -> bool:
    return any(_is_adapter_param(name) for name, _ in model.named_parameters())


def file_name(param: str) -> str:
    """`model.layers.0.q_proj.lora_A.default.weight` -> PEFT's
    `base_model.model.model.layers.0.q_proj.lora_A.weight`."""
    module, kind, adapter, leaf = param.rsplit(".", 3)
    if kind not in _KINDS or adapter != ADAPTER_NAME or leaf != "weight":
        raise AdapterMismatchError(f"{param!r} is not a LoRA parameter of adapter {ADAPTER_NAME!r}")
    return f"{_FILE_PREFIX}{module}.{kind}.weight"


def param_name(file: str) -> str:
    """The inverse of `file_name`."""
    parts = file.rsplit(".", 2)
    if (
        not file.startswith(_FILE_PREFIX)
        or len(parts) != 3
        or parts[1] not in _KINDS
        or parts[2] != "weight"
    ):
        raise AdapterMismatchError(
            f"tensor {file!r} is not named like a PEFT LoRA weight "
            f"('{_FILE_PREFIX}<module>.lora_A.weight')"
        )
    return f"{parts[0].removeprefix(_FILE_PREFIX)}.{parts[1]}.{ADAPTER_NAME}.weight"


def adapter_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(model parameter name, parameter) of every adapter weight, in module order."""
    for name, param in model.named_parameters():
        if _is_adapter_param(name):
            yield name, param


def adapter_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(PEFT file name, detached parameter) of every adapter weight: views of the live
    parameters, so copy them before the model changes if they must outlive this step."""
    return [(file_name(name), param.detach()) for name, param in adapter_params(model)]


def select_adapters(state: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The adapter entries of a (model name, tensor) state (e.g. FSDP's gathered state
    dict) under PEFT file names."""
    return [(file_name(name), tensor) for name, tensor in state if _is_adapter_param(name)]


def copy_adapters(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy adapter tensors (PEFT file names) into the model's adapters in place.

    Every adapter of the model must be given; names and shapes are checked first, so a bad
    set leaves the model as it was (AdapterMismatchError).
    """
    params = dict(adapter_params(model))
    if not params:
        raise AdapterMismatchError(f"{type(model).__name__} has no LoRA adapters to load into")
    given: dict[str, torch.Tensor] = {}
    for file, tensor in tensors.items():
        name = param_name(file)
        param = params.get(name)
        if param is None:
            raise AdapterMismatchError(
                f"adapter tensor {file!r} has no counterpart in the model (it has "
                f"{len(params)} adapter weights, e.g. {file_name(next(iter(params)))!r}); "
                "were the adapters trained with other trainer.lora.target_modules?"
            )
        if tuple(tensor.shape) != tuple(param.shape):
            raise AdapterMismatchError(
                f"adapter tensor {file!r} has shape {tuple(tensor.shape)}, the model's has "
                f"{tuple(param.shape)}; was it trained with another trainer.lora.rank?"
            )
        given[name] = tensor
    missing = [name for name in params if name not in given]
    if missing:
        raise AdapterMismatchError(
            f"no tensor for adapter weight {file_name(missing[0])!r} "
            f"({len(missing)} of {len(params)} missing)"
        )
    with torch.no_grad():
        for name, tensor in given.items():
            params[name].copy_(tensor)


def adapter_config_dict(cfg: LoraConfig, base_model: str | None) -> dict:
    """What `adapter_config.json` holds (PEFT's own serialisation of the config)."""
    data = peft_config(cfg, base_model).to_dict()
    return {key: sorted(value) if isinstance(value, set) else value for key, value in data.items()}


def save_adapter_dir(
    directory: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    cfg: LoraConfig,
    *,
    base_model: str | None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """A PEFT adapter directory (config + safetensors, each written atomically)."""
    from areal.models.weights import save_tensors

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_atomically(
        directory / ADAPTER_CONFIG,
        json.dumps(adapter_config_dict(cfg, base_model), indent=1, sort_keys=True),
    )
    save_tensors(directory, list(tensors), filename=ADAPTER_FILE, metadata=metadata)
    return directory


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_FILE).is_file()


def load_adapter_dir(directory: str | Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of a PEFT directory (PEFT file names)."""
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} holds no {ADAPTER_FILE}: not a LoRA adapter directory"
        )
    return load_file(path)


def merge_into_base(
    base: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], cfg: LoraConfig
) -> dict[str, torch.Tensor]:
    """Base checkpoint tensors with W + (alpha / rank) * B @ A for every adapted layer (in
    float32, cast back to W's dtype); a new dict, `base` is not changed."""
    scaling = cfg.alpha / cfg.rank
    merged = dict(base)
    modules = sorted({param_name(f).rsplit(".", 3)[0] for f in adapters})
    for module in modules:
        key = f"{module}.weight"
        a = adapters.get(f"{_FILE_PREFIX}{module}.lora_A.weight")
        b = adapters.get(f"{_FILE_PREFIX}{module}.lora_B.weight")
        if a is None or b is None or key not in base:
            raise AdapterMismatchError(
                f"cannot merge the adapter of {module!r}: "
                f"{'no base weight ' + repr(key) if key not in base else 'A or B missing'}"
            )
        weight = base[key]
        delta = scaling * (b.float() @ a.float())
        if tuple(delta.shape) != tuple(weight.shape):
            raise AdapterMismatchError(
                f"adapter of {module!r} gives a {tuple(delta.shape)} "
                f"update for a {tuple(weight.shape)} weight"
            )
        merged[key] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
    return merged


def adapter_shapes(
    base_shapes: Mapping[str, tuple[int, ...]], cfg: LoraConfig
) -> dict[str, tuple[int, int]]:
    """PEFT file name -> shape of every adapter weight of a model whose checkpoint has
    `base_shapes`: A [rank, in] and B [out, rank] for each 2-D `<module>.weight` whose last
    name component is one of `cfg.target_modules` (PEFT's suffix match)."""
    targets = set(cfg.target_modules)
    shapes: dict[str, tuple[int, int]] = {}
    for name, shape in base_shapes.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or len(shape) != 2 or module.rpartition(".")[2] not in targets:
            continue
        n_out, n_in = shape
        shapes[f"{_FILE_PREFIX}{module}.lora_A.weight"] = (cfg.rank, n_in)
        shapes[f"{_FILE_PREFIX}{module}.lora_B.weight"] = (n_out, cfg.rank)
    return shapes


def _is_adapter_param(name: str) -> bool:
    parts = name.rsplit(".", 3)
    return len(parts) == 4 and parts[1] in _KINDS and parts[2] == ADAPTER_NAME


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
