"""Model core: GGUF reading, model spec, tokenizer, synthetic writer, reference forward."""
