"""Model files -> a `LoadedModel`: hyperparameters (`config`), typed weights (`weights`, the
weight ABI's Python side), GGUF files (`gguf_file`) and Hugging Face directories
(`hf_dir`), Qwen3-VL's vision encoder (`vision_encoder`, from a Hugging Face directory or
llama.cpp's mmproj GGUF, `mmproj`), conversions (`quant`, `convert`, `convert_vl`), and
`load.load_model`. Of kestreld.vision it imports only `images`."""
