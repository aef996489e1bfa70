"""SFT data: loaders (`formats`), prompt templates (`template`), tokenization, loss masks and
batching (`dataset`), and the embedded default: synthetic arithmetic (`synthetic`) with a
character-level tokenizer (`tokenizer`)."""
