"""`python -m turbo task=serve`: an OpenAI-compatible server over a continuous-batching engine.

scheduler.py runs the requests (one trunk pass a step over every running sequence's rows); the
HTTP side (FastAPI) turns OpenAI requests into `scheduler.Request`s and its `Delta`s into responses.
"""
