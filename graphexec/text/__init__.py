"""Text in and out: tokenizers (the bundled cl100k, a checkpoint's tokenizer.json), a
request's incremental output text and stop strings, chat templates, and grammars (xgrammar)."""
