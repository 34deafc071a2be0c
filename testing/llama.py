"""A small Llama written to disk, to try kvxfer in a vLLM engine without downloading a model.

``write_llama(folder)`` writes ``config.json`` and ``model.safetensors`` (seeded random weights, about 1.3 MB with
the defaults) that vLLM loads as a ``LlamaForCausalLM``. It has no tokenizer: start the engine with
``skip_tokenizer_init=True`` and send prompt token ids (``{"prompt_token_ids": [...]}``). The weights are random
but seeded, and scaled so that every generated token depends on the attention over the KV cache (vLLM's
``load_format="dummy"`` weights do not): a transfer that brings back the wrong bytes changes the tokens.

    python -m kvxfer.testing.llama /tmp/llama     # prints the folder it wrote

Needs torch and safetensors, which every vLLM install has.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["write_llama"]


def write_llama(folder: str | Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 256, vocab: int = 512, seed: int = 0, layer_types: list[str] | None = None,
                sliding_window: int | None = None, max_positions: int = 4096) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for a Llama of the given size into ``folder`` (created if
    missing; existing files of those names are replaced) and return the folder. The same arguments write the same
    bytes. ``layer_types``/``sliding_window``: per-layer attention kinds (for example
    ``["sliding_attention", "full_attention"]`` with ``sliding_window=64``), which gives the engine two KV-cache
    groups. Raises MissingDependencyError (an ImportError) without torch or safetensors."""
    from kvxfer.planner import import_optional  # here: importing kvxfer.testing loads no planner (its pytest plugin)

    torch = import_optional("torch", "kvxfer.testing.write_llama")
    save_file = import_optional("safetensors.torch", "kvxfer.testing.write_llama").save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    if layer_types is not None:
        config["layer_types"] = list(layer_types)
    if sliding_window is not None:
        config["sliding_window"] = sliding_window
    (folder / "config.json").write_text(json.dumps(config, indent=1))

    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> Any:
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w: dict[str, Any] = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0),
                         "model.norm.weight": torch.ones(hidden),
                         "lm_head.weight": rand(vocab, hidden, scale=hidden ** -0.5)}
    proj = hidden ** -0.5
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden, scale=2 * proj)
        w[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden, scale=2 * proj)
        w[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden, scale=proj)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim, scale=proj)
        w[p + "mlp.gate_proj.weight"] = rand(intermediate, hidden, scale=proj)
        w[p + "mlp.up_proj.weight"] = rand(intermediate, hidden, scale=proj)
        w[p + "mlp.down_proj.weight"] = rand(hidden, intermediate, scale=intermediate ** -0.5)
    save_file(w, str(folder / "model.safetensors"))
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        raise SystemExit("usage: python -m kvxfer.testing.llama FOLDER   (writes a small Llama for vLLM there)")
    print(write_llama(sys.argv[1]))
