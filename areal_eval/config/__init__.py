"""Typed configs: strict parsing from dicts and files, the pipeline's sections, and the same as a
pydantic model for the flows' parameters."""
