"""The bundled pass recipes, installed as the package data ``nmdeploy.recipes`` (see setup.py)."""
