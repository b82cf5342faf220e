"""Hugging Face interop: ``config.json`` <-> `ModelConfig` (`config`), the hub-key table (`layout`), safetensors
reading (`safetensors_io`) and `load_hf` (`checkpoint`)."""
