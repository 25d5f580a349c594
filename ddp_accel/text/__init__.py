"""Text pipeline: a basic_english-compatible tokenizer, a vocabulary, data sources, length bucketing, models."""
