"""Text in and out of token ids: the tokenizer (`tokenizer`) and chat templates (`chat`)."""
