"""OpenAI-compatible HTTP API over the engine. No engine logic lives here."""
