"""`tandem bench serve`: the serving benchmark against any OpenAI-compatible endpoint."""
