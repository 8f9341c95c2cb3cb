"""Model files -> a `LoadedModel`: hyperparameters (`config`), typed weights (`weights`, the
weight ABI's Python side), GGUF files (`gguf_file`) and Hugging Face directories
(`hf_dir`), conversions (`quant`, `convert`, `convert_vl`), and `load.load_model`."""
