"""OpenAI-compatible serving: ``python -m engine.entrypoints.openai.api_server``."""
