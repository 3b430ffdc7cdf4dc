"""Load a Hugging Face causal-LM directory for training, scoring and rollout.

Contract: `load_model` returns a transformers model in the requested dtype and device, in eval
mode unless asked otherwise, with an attention implementation under which a padding-free
packed forward (`areal.models.logprobs`) keeps sequences apart: `sdpa` by default, the
flash-attention kernel on CUDA when the `flash_attn` package is importable. Only safetensors
weights are loaded (no pickle). Missing directories, configs or weights fail before
transformers is called, with the path in the message.

Not here: the tokenizer (`areal.models.tokenizer`), building the embedded model
(`areal.models.tiny`), per-token log-probs (`areal.models.logprobs`), weight publishing
(`areal.models.weights`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The weight dtypes a run may ask for (`model.dtype` in the config)."""

PACKING_ATTN_IMPLEMENTATIONS = (
    "sdpa",
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)
"""Attention implementations whose masks transformers 5.x builds per packed sequence.

For these, `transformers.masking_utils.create_causal_mask` recognises restarting
`position_ids` (and no cache, no 2-D mask) as packed sequences; the flash kernels also take
explicit `cu_seq_lens_*`. Anything else (hub kernels, 'paged|...' implementations used by
continuous batching) skips that logic and would let packed sequences attend to each other.
"""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or the torch dtype itself) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype} is not one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def default_attn_implementation(device: str | torch.device) -> str:
    """flash_attention_2 on CUDA when `flash_attn` is installed, otherwise sdpa.

    Both keep packed sequences apart (see PACKING_ATTN_IMPLEMENTATIONS). sdpa builds a dense
    [N, N] boolean mask for a pack of N tokens (about N^2 bytes: 1 GiB at N = 32k), which is
    why the flash kernel, which only needs cumulative lengths, is preferred where it exists.
    """
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def check_model_dir(path: str | Path) -> Path:
    """The directory as a Path, after checking it holds config.json and safetensors weights."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise FileNotFoundError(
            f"model path {str(directory)!r} {what}; give a local Hugging Face model directory "
            "(config.json + *.safetensors)"
        )
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"model path {str(directory)!r} has no config.json; it is not a Hugging Face model "
            "directory"
        )
    if not any(directory.glob("*.safetensors")):
        found = sorted(p.name for p in directory.glob("*.bin"))
        hint = (
            f"; it holds {', '.join(found)}, which is pickle-based: convert it to safetensors first"
            if found
            else ""
        )
        raise FileNotFoundError(f"model path {str(directory)!r} has no *.safetensors weights{hint}")
    return directory


def load_model(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    train: bool = False,
) -> PreTrainedModel:
    """A causal LM from a local directory, on `device`, in `dtype`, in eval mode unless `train`.

    `attn_implementation=None` picks `default_attn_implementation(device)`. Weights are
    loaded from safetensors only (`use_safetensors=True`). The model is built on CPU and then
    moved, which avoids the `accelerate` dependency that `device_map` needs.
    """
    directory = check_model_dir(path)
    torch_dtype = resolve_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(
        directory,
        dtype=torch_dtype,
        trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation or default_attn_implementation(device),
        use_safetensors=True,
    )
    model.to(device)
    return model.train(train)
