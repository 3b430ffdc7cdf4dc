"""The GPU recipe examples/gsm8k_qwen2.5_7b_lora_vllm.yaml, checked on CPU: it loads as a
valid config; its GSM8K prompts render through a Qwen2.5-style chat template (a tokenizer
built here, the shipped GSM8K sample rows); its LoRA options reach vLLM's engine arguments;
and for the real Qwen2.5-7B shape (built on the meta device: no weights) the adapters the
trainer publishes are exactly the ones the vLLM side expects, at the size the recipe says."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal.config import load_config
from areal.models.lora import add_adapters, adapter_config_dict, adapter_shapes, adapter_tensors
from areal.models.tiny import save_tiny_model
from areal.tasks import load_task
from areal.workers.rollout.vllm_engine import VllmEngine

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "gsm8k_qwen2.5_7b_lora_vllm.yaml"
DATA = REPO / "examples" / "data"
sys.path.insert(0, str(REPO / "tests" / "areal" / "tasks"))
from qwen_style import build_qwen_style_tokenizer  # noqa: E402

QWEN25_7B = Qwen2Config(  # config.json of Qwen/Qwen2.5-7B-Instruct
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)


def _model_dir(tmp_path: Path) -> Path:
    directory = save_tiny_model(tmp_path / "model")
    tokenizer = build_qwen_style_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    tokenizer.save_pretrained(directory)
    return directory


def _config(model_dir: Path):
    return load_config(
        RECIPE,
        [
            f"model.path={model_dir}",
            f"task.params.path={DATA / 'gsm8k_train.jsonl'}",
            f"task.params.eval_path={DATA / 'gsm8k_test.jsonl'}",
        ],
    )


def test_the_recipe_loads_and_renders_chat_prompts(tmp_path):
    model_dir = _model_dir(tmp_path)
    cfg = _config(model_dir)
    assert cfg.rollout.engine == "vllm" and cfg.trainer.lora.enabled
    assert cfg.task.params["tokenizer_path"] == str(model_dir)
    task = load_task(cfg.task.name, cfg.task.params)
    prompt = task.eval_prompts()[0]
    assert prompt.text.startswith("<|im_start|>system\n")
    assert prompt.text.endswith("<|im_start|>assistant\n")
    assert "put your final answer within \\boxed{}" in prompt.text
    assert task.stop_strings() == ["<|endoftext|>"]


def test_lora_options_reach_vllm_and_the_adapters_match_on_both_sides(tmp_path):
    cfg = _config(_model_dir(tmp_path))
    lora = cfg.trainer.lora
    engine = VllmEngine(cfg.model.path, device="cpu", lora=lora)
    assert {k: engine._args[k] for k in ("enable_lora", "max_lora_rank", "max_loras")} == {
        "enable_lora": True,
        "max_lora_rank": 32,
        "max_loras": 2,
    }
    with torch.device("meta"):
        model = Qwen2ForCausalLM(QWEN25_7B)
    base_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    add_adapters(model, lora, seed=0)
    published = {n: tuple(t.shape) for n, t in adapter_tensors(model)}
    assert published == adapter_shapes(base_shapes, lora)  # what the vLLM side checks
    num_params = sum(a * b for a, b in published.values())
    assert num_params == 80_740_352  # 161 MB in bf16, as the recipe says
    assert len(published) == 2 * 7 * 28
    config = adapter_config_dict(lora, base_model=cfg.model.path)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (32, 64.0, "LORA")
    assert config["target_modules"] == sorted(lora.target_modules)
