"""Qwen3-VL's images: decoding and preprocessing (`images`), the vision encoder (`encoder`,
from a Hugging Face directory or llama.cpp's mmproj GGUF, `mmproj`), and prompts with
images: placeholders, M-RoPE positions, prefix keys (`prompt`)."""
