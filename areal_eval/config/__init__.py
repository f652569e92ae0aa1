"""Strict typed configs: dataclasses parsed from dicts and files, with errors naming the field."""
