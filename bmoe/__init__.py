"""bmoe: a local LLM server that streams MoE experts from storage."""

__version__ = "0.1.0"
