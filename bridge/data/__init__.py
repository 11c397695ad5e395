"""Data for Bridge: examples, prompt templates, JSONL rows and the built-in synthetic demo sets."""

from bridge.data.example import Example
from bridge.data.sources import build_datasets

__all__ = ["Example", "build_datasets"]
