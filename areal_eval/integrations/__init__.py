"""Plug areal-eval into trainers people already run: drop-ins for AReaL's evaluation classes
(:mod:`areal_eval.integrations.areal`)."""
