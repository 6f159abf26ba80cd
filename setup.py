"""Package layout that pyproject.toml cannot express alone.

The recipes (``passes/``) and the reference data (``models/``) stay in the top-level folders where users look for
them and edit them; here they are mapped into the package as ``nmdeploy.recipes`` and ``nmdeploy.models``, so a wheel
carries them and an editable install reads them in place. Each folder holds an ``__init__.py`` because setuptools'
editable installs only map regular packages.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["nmdeploy", "nmdeploy.*"]), "nmdeploy.recipes", "nmdeploy.models"],
    package_dir={"nmdeploy.recipes": "passes", "nmdeploy.models": "models"},
    package_data={"nmdeploy.recipes": ["*.toml", "*.md"], "nmdeploy.models": ["**/*"]},
    exclude_package_data={"nmdeploy.models": ["**/*.py", "**/__pycache__/*", "**/*.pyc"]},
)
