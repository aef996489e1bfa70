"""LazyTrain: fine-tune LLMs larger than the GPU by streaming layers through it."""

__version__ = "0.1.0"
