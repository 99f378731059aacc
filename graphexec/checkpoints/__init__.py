"""Weights on disk: a Hugging Face config's shapes (`hf_config`), GGUF conversion into a
checkpoint folder, and SmolLM2-135M-Instruct from its package."""
