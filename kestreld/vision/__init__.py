"""Qwen3-VL's images: decoding and preprocessing (`images`), and prompts with images:
placeholders, M-RoPE positions, prefix keys (`prompt`). The vision encoder is part of the
model (kestreld.model.vision_encoder, .mmproj), which imports `images`; nothing here imports
kestreld.model."""
